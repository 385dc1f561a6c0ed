#!/usr/bin/env bash
# One run on a GPU machine: the optimizer step, the train step and the language
# model, smallest first, each under its own time limit so that one overrun keeps
# the others. Results and the log go to $OUT (default benchmarks/results/gpu).
#
#   bash benchmarks/gpu_run.sh                 # on the GPU
#   SIZES=1M STEPS=3 LM_STEPS=20 QUICK=1 bash benchmarks/gpu_run.sh   # a CPU smoke run
#   STAGES="optimizer_step train_step kernels" bash benchmarks/gpu_run.sh  # some stages
#
# Peers the machine lacks (Keras 3, mpx) come as wheels in .whl/, if present.
#
# `rl` runs the RL stage alone (issue 52; examples/rl_float16/rl_long_run.py says what it
# does): GRPO in bfloat16, float16 + lossscale and float32, within RL_BUDGET seconds
# of wall time from this script's start (default 270, 180 with QUICK), each run
# written out to $OUT/rl_long_run_<device>.{json,md,png} as it ends, the log in
# $OUT/rl_long_run.log; a hard stop 20 s after the budget.
#
#   OUT=$OUT RL_BUDGET=270 bash benchmarks/gpu_run.sh rl   # on the GPU: 4.5 min, 5 at most
#   QUICK=1 OUT=/tmp/rl bash benchmarks/gpu_run.sh rl      # a CPU smoke run (180 s)
set -u
if [ "${1:-}" = rl ]; then
    start=$(date +%s.%N)
    OUT=${OUT:-benchmarks/results/gpu}
    mkdir -p "$OUT"
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
    PY=${PY:-python3}
    if [ -n "${QUICK:-}" ]; then budget=${RL_BUDGET:-180}; else budget=${RL_BUDGET:-270}; fi
    export RL_COMMAND="OUT=$OUT RL_BUDGET=$budget${QUICK:+ QUICK=$QUICK} bash benchmarks/gpu_run.sh rl"
    # A rerun on the same machine finds its compiles here.
    export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/jax_cache_rl}
    echo "== rl ($(date +%T)): budget $budget s"
    timeout -k 5 $((${budget%.*} + 20)) $PY examples/rl_float16/rl_long_run.py \
        --budget "$budget" --start-time "$start" --out-dir "$OUT" ${QUICK:+--quick} \
        2>&1 | tee "$OUT/rl_long_run.log"
    status=${PIPESTATUS[0]}
    echo "== rl: exit $status ($(date +%T))"
    if [ -n "${PACK:-}" ]; then tar czf "$PACK" -C "$OUT" .; fi
    ls -la "$OUT"
    exit "$status"
fi
OUT=${OUT:-benchmarks/results/gpu}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
PY=${PY:-python3}
SIZES=${SIZES:-10M,50M}
STEPS=${STEPS:-20}
LM_STEPS=${LM_STEPS:-500}
# The GPU's model, as the results' names give it ("NVIDIA H100 80GB HBM3": h100).
device=$($PY -c "
import re, jax
kind = jax.devices()[0].device_kind.lower() if jax.default_backend() == 'gpu' else 'cpu'
model = re.search(r'\b[a-z]\d{2,4}\b', kind)
print(model.group(0) if model else kind.split()[-1])")
# Which stages run, in this order (default: all but the kernels' attribution).
STAGES=${STAGES:-optimizer_step train_step language_model}
echo "device: $device"

# A smoke test first: if lossscale breaks on this JAX, say so at once.
timeout 120 $PY - <<'EOF'
import jax, jax.numpy as jnp, optax, lossscale, lossscale.flax
print("jax", jax.__version__, "optax", optax.__version__, jax.devices())
params = {"a": jnp.ones((4, 3)), "b": jnp.ones(5)}
tx = optax.adam(1e-3)
grads = jax.tree.map(lambda p: jnp.full_like(p, 2.0**15, jnp.float16), params)
step = jax.jit(lambda p, o, s, g: lossscale.apply_gradients(
    tx, grads=g, params=p, opt_state=o, loss_scale=s))
p, o, s = step(params, tx.init(params), lossscale.DynamicLossScale(), grads)
bad = jax.tree.map(lambda g: g.at[0].set(jnp.inf), grads)
p2, o2, s2 = step(p, o, s, bad)
print("apply_gradients ok:", jax.tree.map(lambda x, y: bool((x == y).all()), p, p2), s2)
wrapped = lossscale.wrap(tx)
updates, state = jax.jit(wrapped.update)(grads, wrapped.init(params), params)
print("wrap ok")
EOF

run() {  # run LIMIT NAME COMMAND...: one stage, its output in the log
    local limit=$1 name=$2
    shift 2
    case " $STAGES " in *" $name "*) ;; *) return ;; esac
    echo "== $name ($(date +%T))"
    timeout "$limit" "$@"
    echo "== $name: exit $? ($(date +%T))"
    # What came back so far, in one file (a device returns few files).
    if [ -n "${PACK:-}" ]; then tar czf "$PACK" -C "$OUT" .; fi
}

run "${OPT_LIMIT:-190}" optimizer_step $PY benchmarks/optimizer_step.py \
    --sizes "$SIZES" --steps "$STEPS" \
    --variants "wrap(tx), dynamic,apply_gradients (one call),TrainState,apply_if_finite,Flax,Keras,mpx" \
    --out "$OUT/optimizer_step_$device"
run "${TRAIN_LIMIT:-60}" train_step $PY benchmarks/train_step.py \
    --models "${TRAIN_MODELS:-mlp-large}" --steps 10 \
    --variants "wrap,apply_gradients,TrainState,Flax,Keras" \
    --out "$OUT/train_step_large_$device"
run "${KERNELS_LIMIT:-60}" kernels $PY benchmarks/kernels.py \
    --size "${KERNELS_SIZE:-50M}" --variants "apply_gradients,wrap(tx), dynamic" \
    --out "$OUT/kernels_$device"
run "${LM_LIMIT:-190}" language_model $PY -m lossscale.demo_language_model \
    --width "${LM_WIDTH:-512}" --layers "${LM_LAYERS:-8}" --heads 8 \
    --context 256 --batch "${LM_BATCH:-128}" --learning-rate 1e-3 \
    --steps "$LM_STEPS" --seeds 0 --eval-batches 16 ${QUICK:+--quick} \
    --runs "float32,bfloat16,float16, no loss scaling,float16, dynamic loss scaling" \
    --out "$OUT/language_model_$device"
ls -la "$OUT"
