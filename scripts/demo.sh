#!/usr/bin/env bash
# The main job: which positional encoding should a language model train with? Trains a small byte-level
# transformer once per posenc encoding on text that ships with Python, evaluates it at 1x-16x its training
# length, writes the table and the plot, exports the best long-context model (TorchScript and torch.export)
# and repeats its evaluation, and a greedy continuation, from C++. About 10 minutes on 2 cores, setup included.
#
#   bash scripts/demo.sh                          # the default run, in build/study
#   bash scripts/demo.sh --preset large           # longer and larger (flags go to scripts/study.py)
#   bash scripts/demo.sh --steps 2000 --dim 192   # any other size; --help lists them
#   PROCESSES=1 bash scripts/demo.sh              # one process instead of torchrun's two
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
OUT=${OUT:-build/study}
PROCESSES=${PROCESSES:-2}
start=$SECONDS
bash scripts/setup.sh
echo "== setup took $((SECONDS - start)) s"

echo "== the study: $PROCESSES process(es), DistributedDataParallel over gloo when more than one"
if [ "$PROCESSES" -gt 1 ]; then
  # One thread per process on 2 cores (the study sets it too; set here, torchrun prints no warning about it).
  OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( ($(nproc) + PROCESSES - 1) / PROCESSES ))} \
  "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node "$PROCESSES" scripts/study.py --out "$OUT" "$@"
else
  "$PYTHON" scripts/study.py --out "$OUT" "$@"
fi

echo "== the exported model from C++ (scripts/study_cpp)"
build/scripts/study_cpp/posenc_study "$OUT/export" | tee "$OUT/cpp_output.txt"

cat <<EOF

== done in $((SECONDS - start)) s
table     $OUT/table.txt  $OUT/results.csv  $OUT/results.json
plot      $OUT/bpb.png
settings  $OUT/settings.json
models    $OUT/export/model.pt (TorchScript)  $OUT/export/model.pt2 (torch.export)
C++       $OUT/cpp_output.txt
EOF
