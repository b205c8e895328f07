#!/bin/bash
# measure_c.sh TAG A B CURVE : agent 64/128 with the given cost curve (A=0 -> base prior 0.95/0.97)
cd /work/main
T=$1; A=$2; Bv=$3; C=$4
if [ "$A" = "0" ]; then A=0.95; Bv=0.97; fi
for n in 64 128; do
  python3 /tmp/h10a/trace_variant.py $A $Bv --tokens $n --model-time runs/$C.json > /tmp/h10a/${T}_agent$n.txt 2>&1
done
echo done > /tmp/h10a/${T}.done
