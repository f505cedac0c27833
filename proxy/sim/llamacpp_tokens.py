"""llama-server's tokenizer endpoints for the simulated llama-server: ``POST /tokenize``,
``/detokenize`` and ``/apply-template``, shaped as the real server answers them.

- ``/tokenize`` ``{"content": str | [str | int, ...], "add_special": false,
  "with_pieces": false}`` -> ``{"tokens": [ids]}`` (with pieces: ``[{"id", "piece"}]``);
  no ``content`` gives ``{"tokens": []}``; ``add_special`` puts the BOS token first, as a
  completion's prompt has it.
- ``/detokenize`` ``{"tokens": [ids]}`` -> ``{"content": text}``.
- ``/apply-template`` ``{"messages": [...]}`` -> ``{"prompt": text}``: the chat template
  the server applies before a chat completion, so ``/tokenize`` of that prompt with
  ``add_special`` counts exactly the ``usage.prompt_tokens`` a chat request gets.

The simulator's tokenizer turns each whitespace-separated piece into an id; the pieces it
has seen are remembered (up to :data:`VOCAB_LIMIT`) so ``/detokenize`` can turn them back.
"""

from __future__ import annotations

from .engine import tokenize

BOS_ID, BOS = 2, "<bos>"
#: Most distinct pieces remembered for /detokenize (beyond it, new pieces are not).
VOCAB_LIMIT = 200_000


class Vocabulary:
    """Token ids of the simulator's tokenizer, and the pieces behind them."""

    def __init__(self, limit: int = VOCAB_LIMIT) -> None:
        self.limit = limit
        self.pieces: dict[int, str] = {BOS_ID: BOS}

    def encode(self, text: str) -> list[tuple[int, str]]:
        pieces = text.split()
        ids = tokenize(text)
        for tid, piece in zip(ids, pieces):
            if tid not in self.pieces and len(self.pieces) < self.limit:
                self.pieces[tid] = piece
        return list(zip(ids, pieces))

    def decode(self, ids: list[int]) -> str:
        """The text of `ids`: a word after another word gets its space back, as the
        pieces of a real tokenizer carry it (``<bos>hello world``)."""
        out = ""
        for piece in (self.pieces.get(i, "") for i in ids):
            if piece:
                out += (" " if out and not out.endswith(BOS) and piece != BOS else "") + piece
        return out


class BadRequest(ValueError):
    """A request the real server refuses with 400 invalid_request_error."""


def tokenize_body(vocab: Vocabulary, obj) -> dict:
    if not isinstance(obj, dict):
        raise BadRequest("request body must be a JSON object")
    content = obj.get("content")
    parts = content if isinstance(content, list) else [content] if content is not None else []
    out: list[tuple[int, str]] = []
    if obj.get("add_special") is True and parts:
        out.append((BOS_ID, BOS))
    for part in parts:
        if isinstance(part, bool) or not isinstance(part, (str, int)):
            raise BadRequest('"content" elements must be strings or token ids')
        if isinstance(part, int):
            out.append((part, vocab.pieces.get(part, "")))
        else:
            out += vocab.encode(part)
    if obj.get("with_pieces") is True:
        return {
            "tokens": [{"id": i, "piece": (" " if n else "") + p} for n, (i, p) in enumerate(out)]
        }
    return {"tokens": [i for i, _ in out]}


def detokenize_body(vocab: Vocabulary, obj) -> dict:
    if not isinstance(obj, dict):
        raise BadRequest("request body must be a JSON object")
    ids = obj.get("tokens", [])
    if not isinstance(ids, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) for i in ids
    ):
        raise BadRequest('"tokens" must be a list of token ids')
    return {"content": vocab.decode(ids)}


def apply_template_body(obj, chat_text) -> dict:
    if not isinstance(obj, dict) or "messages" not in obj:
        raise BadRequest("'messages' is required")
    if not isinstance(obj["messages"], list):
        raise BadRequest("Expected 'messages' to be an array")
    return {"prompt": chat_text(obj["messages"])}
