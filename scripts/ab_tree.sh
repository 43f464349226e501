#!/usr/bin/env bash
# A copy of another commit beside the working tree, to time both in one device call (machines
# differ by more than most changes, so an A/B belongs on one machine):
#
#   bash scripts/ab_tree.sh REV            # here: ab/<short hash>, the commit's files without the demo
#                                          # pair's weights, receipts and images (a device call
#                                          # carries 64 MiB in all; ab/ is git-ignored: carry it)
#   bash scripts/ab_tree.sh --weights      # on the device: the demo weights into every ab/*
#   cd ab/<hash> && PYTHONPATH=/root/mlx-site:$PWD python3 benchmarks/...   # the old arm
set -eu
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--weights" ]; then
  for tree in ab/*/; do
    for part in outrider/demo/pair/*/; do
      cp "$part"model.safetensors "$tree$part" 2>/dev/null || true
    done
  done
  exit 0
fi
rev=${1:?usage: ab_tree.sh REV | --weights}
dir="ab/$(git rev-parse --short "$rev")"
rm -rf "$dir"
mkdir -p "$dir"
git archive "$rev" | tar -x -C "$dir"
rm -rf "$dir"/outrider/demo/pair/*/model.safetensors "$dir"/docs/receipts "$dir"/docs/images
echo "$dir: $(du -sh "$dir" | cut -f1) (carry \"ab\" with the device call)"
