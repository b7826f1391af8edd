# Sourced by the GPU machine's scripts: where results go ($OUT), the environment every
# run there needs (NVLink multicast off, as the device notes ask), and ddpgraph installed
# from this tree without touching the machine's packages (it reaches no registry).
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src:$PWD/tests
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0} TORCH_SYMM_MEM_DISABLE_MULTICAST=${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1}
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
