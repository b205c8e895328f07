#!/bin/bash
# usage: measure.sh TAG  -> /tmp/h10a/TAG_{agent64,agent128,chat64,chat128}.txt
cd /work/main
T=$1
B=runs/issue17-bench9-mkl.json
CHAT=code-1,code-2,code-3,math-1,math-2,math-3,prose-1,prose-2,prose-3
for n in 64 128; do
  python3 scripts/agent_trace.py --tokens $n --model-time $B > /tmp/h10a/${T}_agent$n.txt 2>&1
  python3 scripts/agent_trace.py --tokens $n --model-time $B --kinds code,math,prose --prompts $CHAT --sources dflash,lookup > /tmp/h10a/${T}_chat$n.txt 2>&1
done
echo done > /tmp/h10a/${T}.done
