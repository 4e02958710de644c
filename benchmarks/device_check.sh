#!/usr/bin/env bash
# The prepared run for a lent GPU machine (docs/attention.md, docs/keras_hub.md, docs/plan.md):
# one command of at most 10 minutes whose sections each have a time limit, so that a slow one
# costs only its own figures. Run from the repository root:
#
#     bash benchmarks/device_check.sh OUT_FOLDER            # on the GPU machine
#     DEVICE_CHECK_TINY=1 bash benchmarks/device_check.sh /tmp/dc   # seconds, any machine
#     SECTIONS="versions peer" bash benchmarks/device_check.sh OUT_FOLDER   # some sections
#
# The GPU machine has Python 3.12 with JAX (CUDA), PyTorch and transformers, no TensorFlow and
# no network: keras, keras-hub and their small pure dependencies travel as wheels in `.whl/`
# (docs/attention.md says which), installed here with --no-deps into /tmp/site, and
# tensorflow-cpu (the library imports TensorFlow on every backend) already installed there
# (it travels in five parts, docs/attention.md). Everything runs on Keras's JAX backend. Sections, in order of what they decide:
#
#   lm_gemma7b  (only when SECTIONS names it) benchmarks.lm_step, Gemma-7B shape, seq 8192, "full" with and without the
#               chunked loss: XLA:GPU's plan compiled on the device and the allocator's peak
#   lm_gemma2b  (only when named) the same at Gemma-2B shape
#   plan_bert, plan_bert_full  benchmarks.device_plan_check: the h100 plan of BERT-base seq 512
#               in 16 GiB (docs/plan.md) checked by real steps at its micro-batch and the next
#   offload_probe  benchmarks.offload_probe on the device: does XLA:GPU keep offloaded inputs
#               on the host (the CPU-side plan: the policy keeps them on the device too, the
#               library's offload=True moves them all)?
#   peer        benchmarks.peer, BERT-base seq 512: "full" (our side only; RECOMPUTE=0 and
#               PyTorch's rows were measured on an H100 before, docs/attention.md)
#
# Each section's output goes to OUT_FOLDER/device.log (and its JSON beside it); the end of
# each is printed too.
set -u
out=${1:?usage: bash benchmarks/device_check.sh OUT_FOLDER}
mkdir -p "$out"
log="$out/device.log"
: >"$log"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
export KERAS_BACKEND=jax PYTHONUNBUFFERED=1
python=${PYTHON:-python3}

# The default leaves out the lm sections (measured 2026-11-28, docs/keras_hub.md): a BERT-base
# step compiles for one to two minutes on the card, so the planner's checks and peer's row
# need the time.
sections=" ${SECTIONS:-versions offload_probe plan_bert plan_bert_full peer} "

section() {  # name, seconds, command...
    local name=$1 limit=$2 start=$SECONDS
    shift 2
    case "$sections" in *" $name "*) ;; *) return 0 ;; esac
    echo "=== $name: $* (limit ${limit} s, $(date -u +%FT%TZ))" | tee -a "$log"
    timeout "$limit" "$@" >"$out/$name.txt" 2>&1
    local rc=$?
    grep -v -e '^I0000' -e '^W0000' -e 'absl::InitializeLog' "$out/$name.txt" | tail -n 40 >>"$log"
    rm -f "$out/$name.txt"
    echo "=== $name: exit $rc after $((SECONDS - start)) s" | tee -a "$log"
    tail -n 14 "$log"
}

if [ -n "${DEVICE_CHECK_TINY:-}" ]; then
    lm="--model tiny --seq 64 --vocab 1000 --layers 2 --dtype float32 --steps 2"
    lm2=$lm
    peer="--layers 2 --hidden 64 --heads 2 --ffn 128 --seq 32 --batches 2,4 --steps 2 --no-peer"
    plan="--layers 1 --hidden 32 --heads 2 --ffn 64 --seq 16 --vocab 2000 --effective-batch 16 --budget-gib 0.02"
    plan_none=2,4
    plan_full=2,4
else
    lm="--model gemma-7b --seq 8192 --steps 3"
    lm2="--model gemma-2b --seq 8192 --steps 3"
    peer="--batches 8,32 --steps 3 --no-peer"
    plan=""
    # docs/plan.md's h100 plan of BERT-base (16 GiB, effective batch 256): None at 16 (32
    # refused), "full" at 128 (256 refused): each checked at its micro-batch and the next
    plan_none=16,32
    plan_full=128,256
fi

section versions 25 sh -c "nvidia-smi -L; $python -c 'import jax, keras, keras_hub, recompute, tensorflow as tf; print(\"jax\", jax.__version__, jax.devices(), \"keras\", keras.__version__, \"keras-hub\", keras_hub.__version__, \"tensorflow\", tf.__version__)'"
# shellcheck disable=SC2086
section lm_gemma7b 225 "$python" -m benchmarks.lm_step $lm --modes chunked,full --json "$out/lm_gemma7b.json"
# shellcheck disable=SC2086
section lm_gemma2b 80 "$python" -m benchmarks.lm_step $lm2 --modes chunked,full --json "$out/lm_gemma2b.json"
section offload_probe 25 "$python" -m benchmarks.offload_probe
# shellcheck disable=SC2086
section plan_bert 150 "$python" -m benchmarks.device_plan_check $plan --policies none --start-sizes $plan_none --target none --deadline 145 --json "$out/plan_bert.json"
# shellcheck disable=SC2086
section plan_bert_full 150 "$python" -m benchmarks.device_plan_check $plan --policies full --start-sizes $plan_full --target none --deadline 145 --json "$out/plan_bert_full.json"
# shellcheck disable=SC2086
section peer 200 "$python" -m benchmarks.peer $peer --policies full --json "$out/peer.json"
echo "=== done $(date -u +%FT%TZ)" | tee -a "$log"
