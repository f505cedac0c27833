#!/usr/bin/env bash
# Fetch into .whl/ (repository root) the wheels phasewatch needs on a GPU machine that has
# PyTorch and nvidia-ml-py but no package registry: CPython 3.12, manylinux x86_64, no
# dependencies resolved (the list is whole). tests/device/gpu_power_check.py's docstring
# gives the command that installs them there.
set -euo pipefail
cd "$(dirname "$0")/../.."
PKGS=(annotated_doc==0.0.7 annotated_types==0.8.0 anyio==4.16.0 certifi==2026.10.19.post1
      click==8.5.1 fastapi==0.165.0 fastapi_offline==1.7.7 h11==0.16.0 httpcore==1.0.9
      httptools==0.9.0 httpx==0.29.0 idna==3.20 nvidia_ml_py==13.615.71
      opentelemetry_api==1.45.2 prometheus_client==0.26.0 pydantic==2.14.4
      pydantic_core==2.50.5 pydantic_settings==2.16.3 python_dotenv==1.2.4 starlette==1.10.0
      typing_extensions==4.16.0 typing_inspection==0.4.5 uvicorn==0.54.0)
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "${PKGS[@]}"
ls .whl
