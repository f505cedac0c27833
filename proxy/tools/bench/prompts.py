"""Chat prompts of a given token length for one model.

Exact where the engine has a tokenizer (the engine registry's
:func:`~proxy.engines.find_tokenizer`: vLLM's and llama-server's ``/tokenize``), checked
against the ``usage`` of the warm-up request; otherwise the length comes from a
calibration of words to tokens on two requests' ``usage``, and is an estimate. Every
prompt starts with different words, so a prefix cache cannot serve a repetition.
"""

from __future__ import annotations

import random
import time

from ...engines import Tokenizer, find_tokenizer
from .client import Client

#: Common words that most tokenizers (Llama, Qwen, Mistral, GPT) keep as one token each
#: with their leading space, so word counts track token counts closely.
_VOCAB = (
    "the of and to in is was for on that with as by at from his her they this had not are "
    "but have one all were there when what your can said which their will each about how up "
    "out them then she many some so these would other into has more two like him see time "
    "could no make than first been its who now people my made over did down only way find "
    "use may water long little very after words called just where most know get through "
    "back much go good new write our me man too any day same right look think also around "
    "another came come work three word must because does part even place well such here take "
    "why things help put years different away again off went old number great tell men say "
    "small every found still between name should home big give air line set own under read "
    "last never us left end along while might next sound below saw something thought both "
    "few those always looked show large often together asked house world going want school "
    "important until form food keep children feet land side without boy once animals life "
    "enough took sometimes four head above kind began almost live page got earth need far "
    "hand high year mother light parts country father let night following picture being study "
    "second eyes soon times story boys since white days paper hard near sentence better best "
    "across during today others however sure means knew try told young miles sun ways thing "
    "whole hear example heard several change answer room sea against top turned learn point "
    "city play toward five using himself usually"
).split()


class Prompts:
    """Makes chat prompts of a given token length for one model."""

    def __init__(self, client: Client, model: str, seed: int) -> None:
        self.client = client
        self.model = model
        self.rng = random.Random(seed)
        #: the engine whose tokenizer counts (vllm | llamacpp), else calibrated | rough
        self.kind = "none"
        self.tokenizer: Tokenizer | None = None
        self.offset = 0  # usage.prompt_tokens - what our counting says (template, BOS)
        self.per_word = 1.0
        self.overhead = 0.0
        self.max_model_len: int | None = None
        self.fixed = 0.0  # tokens a prompt has besides its words (template, BOS)
        self.seconds = 0.0  # spent making prompts (tokenizer calls), wall time
        self._active, self._since = 0, 0.0
        self.calls = 0  # tokenizer calls

    @property
    def method(self) -> str:
        if self.tokenizer is not None:
            return "exact: the engine's /tokenize" + (
                f" (checked against usage, offset {self.offset:+d})"
                if self.offset
                else " (checked against usage)"
            )
        if self.kind == "calibrated":
            return (
                f"estimate: calibrated on usage ({self.per_word:.3f} tokens/word + "
                f"{self.overhead:.0f}), no tokenizer endpoint"
            )
        return "rough estimate: no tokenizer endpoint and no usage (1.3 tokens/word assumed)"

    def words(self, n: int) -> str:
        # a fresh random order per prompt: no two prompts share a prefix (no cache hits)
        return " ".join(self.rng.choice(_VOCAB) for _ in range(max(1, n)))

    async def setup(self) -> None:
        found = await find_tokenizer(self.client.http, self.model)
        if found is not None:
            self.kind, self.tokenizer = found
            self.max_model_len = self.tokenizer.max_model_len
            return
        # no tokenizer: two requests' usage give tokens per word and the template's overhead
        a, b = 64, 1024
        ta = await self.client.usage_prompt_tokens(self.model, self.words(a))
        tb = await self.client.usage_prompt_tokens(self.model, self.words(b))
        if ta and tb and tb > ta:
            self.kind = "calibrated"
            self.per_word = (tb - ta) / (b - a)
            self.overhead = ta - self.per_word * a
        else:
            self.kind, self.per_word, self.overhead = "rough", 1.3, 10.0

    async def count(self, text: str) -> int | None:
        self.calls += 1
        if self.tokenizer is None:
            return None
        return await self.tokenizer.count(text) + self.offset

    async def make(self, tokens: int) -> tuple[str, int]:
        """A prompt of `tokens` tokens (exact where countable) and its expected length."""
        if not self._active:  # wall time while any prompt is being made
            self._since = time.monotonic()
        self._active += 1
        try:
            return await self._make(tokens)
        finally:
            self._active -= 1
            if not self._active:
                self.seconds += time.monotonic() - self._since

    async def _make(self, tokens: int) -> tuple[str, int]:
        if self.tokenizer is None:
            n = max(1, round((tokens - self.overhead) / self.per_word))
            return self.words(n), tokens
        # count ~= fixed + per_word * words (the template's tokens, then the words'); both
        # are learnt from every count, so after the first prompts one call usually hits
        pool = [self.rng.choice(_VOCAB) for _ in range(int(tokens * 1.5) + 64)]
        n = max(1, min(len(pool), round((tokens - self.fixed) / self.per_word)))
        best: tuple[str, int] | None = None
        last: tuple[int, int] | None = None
        for _ in range(10):
            text = " ".join(pool[:n])
            got = await self.count(text)
            assert got is not None  # counting works for the engines with a tokenizer
            if best is None or abs(got - tokens) < abs(best[1] - tokens):
                best = (text, got)
            if got == tokens:
                break
            if last is not None and last[0] != n and got != last[1]:
                self.per_word = max(0.2, min(5.0, (got - last[1]) / (n - last[0])))
            self.fixed = got - self.per_word * n
            last = (n, got)
            guess = round((tokens - self.fixed) / self.per_word)
            if guess == n:
                guess += 1 if got < tokens else -1
            n = max(1, min(len(pool), guess))
        assert best is not None
        return best

    async def check(self, usage_tokens: int | None, counted: int) -> None:
        """Learn the difference between our count and the engine's usage (template, BOS)."""
        if usage_tokens is not None and self.tokenizer is not None:
            self.offset += usage_tokens - counted
