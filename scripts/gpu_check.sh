#!/usr/bin/env bash
# The prepared GPU check of issues 46 and 65, in five parts sized for ~6 minutes each on one H100 /
# H200 (two fit in a 15-minute lease with the machine's start); each stage has a time limit, and a
# part's limits add up to 7 minutes at most. Prepare once here, on the CPU box:
#
#   bash scripts/gpu_wheels.sh        # .whl/: ml-collections, dp-accounting, tensorboardX
#
# then, on the GPU (the device tool: carry [".whl"]; $OUT is the folder that comes back):
#
#   bash scripts/gpu_check.sh core    # ResNet-18 FedBYOL round, 10 clients x 5 steps x batch 64,
#                                     # `flip` views: map / vmap in float32 and bfloat16,
#                                     # the eager PyTorch loop (TF32, bf16) and one PyTorch model
#                                     # on the union batch (bf16 channels_last, float32), ratios,
#                                     # TFLOP/s, a jax.profiler summary of map and vmap in bf16,
#                                     # and the same programs again from the compilation cache
#   bash scripts/gpu_check.sh conv    # the same round's convolutions (PERF-50: grouped under vmap):
#                                     # conv_impl='im2col' (batched matmuls) and the default, each
#                                     # beside the union-batch PyTorch model (XLA's NCHW layout:
#                                     # no gain, PERF-52)
#   bash scripts/gpu_check.sh packed  # issue 65 items 1-2: the same round (vmap, bf16) with
#                                     # conv_impl='packed' (activations [N,H,W,K*C] across layers)
#                                     # beside the union-batch PyTorch model, then 'measured' (each
#                                     # convolution timed as grouped / loop / vmap once, its choice
#                                     # in CACHE/conv_impl.json, copied back); the anchor ('xla',
#                                     # the default) is part conv's `default` stage (PERF-53)
#   bash scripts/gpu_check.sh pallas  # issue 65 item 3: each distinct ResNet-18 convolution (K = 10
#                                     # clients x batch 128, bf16) forward + both gradients: the
#                                     # Pallas kernel (ops/pallas_conv.py) against XLA's grouped
#                                     # convolution on the packed layout (cuDNN) and the default
#                                     # vmap form, then the kernel with 128 x 128 tiles (PERF-69)
#   bash scripts/gpu_check.sh extra   # 100 clients / 10 a round against the eager loop of the same
#                                     # participants; FedU2's round parts (FUR, EUA) and the eager
#                                     # loop of its cross-silo participants (B = 128)
#   bash scripts/gpu_check.sh seeds   # issue 65 item 5: FedU2 (cross-silo, cross-device), FedSC
#                                     # (DP shares), Hetero-SSFL (ResNet-34 + ResNet-18) and FedEMA
#                                     # at their papers' model, image, batch and E (one batch per
#                                     # epoch): our round in bf16 beside the eager PyTorch loop
#                                     # written as the official codes (TF32) and the union-batch
#                                     # model (bf16), one process per method (PERF-76)
#   bash scripts/gpu_check.sh auto    # the train binary (configs/gpu_round.py, bf16): a first run
#                                     # measures strategy='auto' and compiles; a second run of the
#                                     # same config reads both caches
#   bash scripts/gpu_check.sh export  # the train binary (configs/gpu_round.py, bf16, vmap) twice
#                                     # with one fresh cache folder: the first run exports its
#                                     # round (jax.export) and compiles it, the second loads the
#                                     # export untraced and compiles from the persistent cache
#                                     # (issue 65 item 4: <= 5 s of compile before round 1)
#
# Each part writes check_<part>.log and its JSON files (at most 8 files) to $OUT (default
# docs/results/gpu/check_<part>); every stage has a time limit, so a stage that runs long ends the
# stage, not the part. Commit what comes back under docs/results/gpu/ (docs/notes/performance.md
# #gpu-check says how to read it). SMOKE=1 runs every stage on a tiny model and round instead (the
# CPU test of this script, tests/experiments/test_gpu_check.py).
set -uo pipefail
cd "$(dirname "$0")/.."
PART=${1:-core}
case "$PART" in core|conv|packed|pallas|extra|seeds|auto|export) ;; *) echo "error: part = '$PART' is invalid: must be core, conv, packed, pallas, extra, seeds, auto or export" >&2; exit 1;; esac
OUT=${OUT:-docs/results/gpu/check_$PART}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/check_$PART.log") 2>&1
T0=$(date +%s)
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
CACHE=$(mktemp -d /tmp/fedjax_ssl_cache.XXXX)  # a cold cache: the first compile is measured
# Dense peaks of the H100 / H200 SXM (the same chip): TF32 ~495 TFLOP/s (XLA's and PyTorch's
# float32 matmuls and convolutions run as TF32), bf16 ~989.
PEAKS=${PEAKS:-495,989}
M=resnet18 C=10 C100=100 E=5 B=64 B128=128 R=3 IMAGES=640 TRAIN_ARGS=() UNION=(--torch_variants=torch_union)
# Part seeds: per method a stage limit (s) and its timed rounds after the warm-up.
SEEDS=${SEEDS:-fedu2_cross_silo:70:2 fedu2_cross_device:100:1 fedsc:50:2 hetero_ssfl:75:2 fedema:45:2}
SEED_ARGS=(--scale=paper --variants=ours_bf16,torch,torch_union)
LAYERS=()
if [ "${SMOKE:-0}" = 1 ]; then
  SEED_ARGS=(--scale=reduced --variants=ours,torch,torch_union_fp32)
  M=small_cnn C=3 C100=6 E=1 B=8 B128=8 R=1 IMAGES=16 UNION=(--notorch) LAYERS=(--smoke --batch=2)
  TRAIN_ARGS=(--config.encoder=mlp --config.num_clients=3 --config.clients_per_round=3
              --config.train_size=96 --config.rounds=1 --config.heads=custom)
fi

stage() {  # stage NAME LIMIT_SECONDS COMMAND...
  local name=$1 limit=$2; shift 2
  echo "=== $name: start at +$(( $(date +%s) - T0 ))s (limit ${limit}s): $*"
  timeout --signal=TERM --kill-after=10 "$limit" "$@"
  echo "=== $name: exit $? at +$(( $(date +%s) - T0 ))s"
}

stage env 60 "$PY" - "$OUT/env_$PART.json" <<'EOF'
import json, platform, subprocess, sys
info = {'python': platform.python_version()}
for name in ('jax', 'jaxlib', 'flax', 'optax', 'orbax.checkpoint', 'torch', 'numpy'):
  try:
    info[name] = __import__(name, fromlist=['_']).__version__
  except Exception as e:  # pylint: disable=broad-except
    info[name] = f'unavailable: {e}'
import jax
info['devices'] = [f'{d.platform}:{d.device_kind}' for d in jax.devices()]
try:
  info['nvidia_smi'] = subprocess.run(
      ['nvidia-smi', '--query-gpu=name,memory.total,driver_version,clocks.max.sm',
       '--format=csv,noheader'], capture_output=True, text=True, timeout=20).stdout.strip()
except Exception as e:  # pylint: disable=broad-except
  info['nvidia_smi'] = f'unavailable: {e}'
print(json.dumps(info, indent=1))
json.dump(info, open(sys.argv[1], 'w'), indent=1)
EOF

case "$PART" in
core)
  # Four cold compiles of 20-34 s and the PyTorch warm-ups (H100, PERF-50: with map5 as well, six
  # compiles did not leave the 300 s any time to time the rounds; `auto` times map5).
  stage bench 300 "$PY" -m experiments.benchmark --models=$M --clients=$C \
    --augmentations=flip --local_steps=$E --batch_size=$B --repeats=$R \
    --variants=map,vmap --precisions=float32,bfloat16 --peak_tflops="$PEAKS" \
    --torch_variants=torch,torch_bf16,torch_union,torch_union_fp32 \
    --profile_dir=/tmp/profile --profile_variants=map/bfloat16,vmap/bfloat16 \
    --cache_dir="$CACHE" --out="$OUT/bench_c10.json"
  # The same programs in a new process with the cache the first one filled: what a second run or
  # seed pays to compile its round (the 'compile' entries).
  stage bench_warm 80 "$PY" -m experiments.benchmark --models=$M --clients=$C \
    --augmentations=flip --local_steps=$E --batch_size=$B --repeats=1 \
    --variants=map,vmap --precisions=float32,bfloat16 --notorch \
    --cache_dir="$CACHE" --out="$OUT/bench_c10_warm.json"
  ;;
conv)
  # The alternative to PERF-50's grouped convolutions beside the union-batch PyTorch model in its
  # process (ratios in one run); PERF-52 has its first numbers.
  stage im2col 150 "$PY" -m experiments.benchmark --models=$M --clients=$C \
    --augmentations=flip --local_steps=$E --batch_size=$B --repeats=$R \
    --variants=vmap --precisions=bfloat16 --peak_tflops="${PEAKS#*,}" --conv_impl=im2col \
    --profile_dir=/tmp/profile --torch_variants=torch_union --cache_dir="$CACHE" \
    --out="$OUT/conv_im2col.json"
  # The default convolutions beside the same references in this sitting: the anchor of the
  # alternative, the ratios of issue 46 on this card, and PERF-51's shorter vmap trace, measured
  # cold (the 'compile' entries).
  stage default 120 "$PY" -m experiments.benchmark --models=$M --clients=$C \
    --augmentations=flip --local_steps=$E --batch_size=$B --repeats=$R \
    --variants=vmap --precisions=bfloat16 --peak_tflops="${PEAKS#*,}" \
    --torch_variants=torch,torch_union --out="$OUT/conv_default.json"
  ;;
packed)
  # Issue 65 item 1: one compile (cold, measured) and R timed rounds beside the union-batch model.
  stage packed 150 "$PY" -m experiments.benchmark --models=$M --clients=$C \
    --augmentations=flip --local_steps=$E --batch_size=$B --repeats=$R \
    --variants=vmap --precisions=bfloat16 --peak_tflops="${PEAKS#*,}" --conv_impl=packed \
    "${UNION[@]}" --cache_dir="$CACHE" --out="$OUT/conv_packed.json"
  # Item 2: the first trace times every convolution equation's candidates (ResNet-18: ~60, each
  # three small compiles), prints them and stores the choices; then the round as chosen.
  stage measured 200 "$PY" -m experiments.benchmark --models=$M --clients=$C \
    --augmentations=flip --local_steps=$E --batch_size=$B --repeats=$R \
    --variants=vmap --precisions=bfloat16 --peak_tflops="${PEAKS#*,}" --conv_impl=measured \
    --notorch --cache_dir="$CACHE" --out="$OUT/conv_measured.json"
  cp "$CACHE/conv_impl.json" "$OUT/conv_impl_choices.json" 2>/dev/null
  ;;
pallas)
  # Issue 65 item 3: 11 layer shapes x 3 implementations in bf16 (the round's precision), one
  # compile each (the Pallas kernel's strided input gradient is four), then R + 2 timed calls; then
  # the kernel alone with 128 x 128 tiles (8 warps), the tile sweep's second point (PERF-69). Each
  # stage writes its JSON even when its limit ends it (the rows measured so far).
  stage layers_bf16 200 "$PY" -m experiments.conv_layers --clients=$C --repeats=$((R + 2)) \
    --dtype=bfloat16 "${LAYERS[@]}" --out="$OUT/pallas_layers_bf16.json"
  stage layers_t128 100 "$PY" -m experiments.conv_layers --clients=$C --repeats=$((R + 2)) \
    --dtype=bfloat16 --impls=pallas --tiles=128,128,32 "${LAYERS[@]}" \
    --out="$OUT/pallas_layers_bf16_t128.json"
  ;;
extra)
  stage bench_c100 150 "$PY" -m experiments.benchmark --models=$M --clients=$C100 \
    --participants=$C --augmentations=flip --local_steps=$E --batch_size=$B --repeats=$R \
    --variants=map/bfloat16,vmap/bfloat16,map5/bfloat16 --precisions=float32,bfloat16 \
    --peak_tflops="$PEAKS" --torch_variants=torch,torch_bf16,torch_union \
    --out="$OUT/bench_c100_p10.json"
  # FedU2's own costs and its round (configs/fedu2/paper_cross_silo.py's model and batch: ResNet-18,
  # 512-2048-512 heads, B = 128; 10 participants of 640 images, one local epoch = 5 steps) ...
  stage fedu2 150 "$PY" -m experiments.fedu2.timing --batch_sizes=$B128 --clients=$C \
    --round_clients=$C --round_images=$IMAGES --repeats=2 --strategy=map --encoder=$M \
    --out="$OUT/fedu2_round.json"
  # ... and the eager PyTorch loop of the same participants, steps and batch (BYOL: the official
  # code's FUR and EUA are not in the PyTorch reference, so this loop is a lower bound of its time).
  stage fedu2_eager 60 "$PY" -m experiments.benchmark --models=$M --clients=$C \
    --augmentations=flip --local_steps=$E --batch_size=$B128 --repeats=2 --variants= \
    --torch_variants=torch,torch_bf16 --out="$OUT/eager_c10_b128.json"
  ;;
seeds)
  # Each method in its own process (its three variants interleaved in it), so that a stage cut
  # at its limit costs that method only; seeds_<method>.json is rewritten as each row completes.
  for item in $SEEDS; do
    IFS=: read -r name limit reps <<< "$item"
    stage "seeds_$name" "$limit" "$PY" -m experiments.seed_speed --settings="$name" \
      "${SEED_ARGS[@]}" --repeats="$reps" --out="$OUT/seeds_$name.json"
  done
  ;;
auto)
  for run in first second; do
    stage "train_$run" 180 "$PY" -m experiments.train --config configs/gpu_round.py \
      --workdir "/tmp/gpu_round_$run.$$" --cache_dir "$CACHE" --config.precision=bfloat16 \
      "${TRAIN_ARGS[@]}"
    cp "/tmp/gpu_round_$run.$$/results.json" "$OUT/train_${run}_results.json" 2>/dev/null
    grep -h " step: \|), strategy '" "/tmp/gpu_round_$run.$$/train.log" 2>/dev/null | cut -c1-400
  done
  cp "$CACHE/strategy.json" "$OUT/strategy_cache.json" 2>/dev/null
  ;;
export)
  # results.json's first_round: export ('written', then 'loaded'), trace / lower / XLA seconds,
  # persistent-cache hits and process_seconds_at_start (data loading and imports included); the
  # strategy is pinned so that no autotune compile enters either run (PERF-60).
  for run in first second; do
    stage "export_$run" 170 "$PY" -m experiments.train --config configs/gpu_round.py \
      --workdir "/tmp/gpu_export_$run.$$" --cache_dir "$CACHE" --config.precision=bfloat16 \
      --config.strategy=vmap "${TRAIN_ARGS[@]}"
    cp "/tmp/gpu_export_$run.$$/results.json" "$OUT/export_${run}_results.json" 2>/dev/null
    grep -h " step: " "/tmp/gpu_export_$run.$$/train.log" 2>/dev/null | cut -c1-400
  done
  ls -la "$CACHE/exports"
  ;;
esac
echo "=== done at +$(( $(date +%s) - T0 ))s; files in $OUT:"
ls -la "$OUT"
