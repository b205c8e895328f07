#!/bin/bash
cd /work/main
T=$1; A=$2; Bv=$3
for n in 64 128; do
  python3 /tmp/h10a/trace_variant.py $A $Bv --tokens $n --model-time runs/issue17-bench9-mkl.json > /tmp/h10a/${T}_agent$n.txt 2>&1
done
echo done > /tmp/h10a/${T}.done
