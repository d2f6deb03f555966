#!/bin/bash
# Served cost of the sampling filters: serves MODEL ("" for the default) from the checkout SRC_DIR
# on a loopback port, runs `vivace bench` greedy, with top_p 0.9 and with top_k 64 + top_p 0.95
# (temperature 0.7), and prints the engine's mean sample and forward phase a step (from /metrics,
# before and after each run) and the bench's ITL. Run it for two checkouts, one after the other:
#   PY=.venv/bin/python CONC=16 NREQ=32 benchmarks/sampling_served.sh after "$PWD" "" ""
# usage: sampling_served.sh NAME SRC_DIR MODEL "ENV"
PY=${PY:-python}; PY=$(cd "$(dirname "$(command -v "$PY")")" && pwd)/$(basename "$PY")  # absolute, the venv kept
OUT=${OUT:-/tmp/vivace-sampling}; mkdir -p $OUT
NAME=$1; SRC=$2; MODEL=$3; ENVS=$4
PORT=18077
cd $SRC
env $ENVS PYTHONPATH=$SRC $PY -m vivace.cli serve $MODEL --host 127.0.0.1 --port $PORT > $OUT/$NAME.log 2>&1 &
PID=$!
for i in $(seq 1 240); do curl -sf http://127.0.0.1:$PORT/health >/dev/null && break; sleep 1; done
for cfg in greedy:'{}' topp:'{"top_p":0.9}' topk:'{"top_k":64,"top_p":0.95}'; do
  c=${cfg%%:*}; eb=${cfg#*:}; T=0.7; [ $c = greedy ] && T=0
  curl -s http://127.0.0.1:$PORT/metrics | grep 'engine_step_seconds_\(sum\|count\)' > $OUT/m0
  $PY -m vivace.cli bench --base-url http://127.0.0.1:$PORT --api completions --output-control ignore_eos \
     --temperature $T --extra-body "$eb" --input-len 128 --output-len 128 --num-requests ${NREQ:-6} --warmup 1 --concurrency ${CONC:-1} \
     --no-progress --output-json $OUT/$NAME-$c.json > /dev/null 2>&1
  curl -s http://127.0.0.1:$PORT/metrics | grep 'engine_step_seconds_\(sum\|count\)' > $OUT/m1
  $PY -c "
import re
def rd(f):
  out={}
  for line in open(f):
    k,v=line.rsplit(' ',1); out[k]=float(v)
  return out
a,b=rd('$OUT/m0'),rd('$OUT/m1')
d={k:b[k]-a.get(k,0) for k in b}
parts=[]
for ph in ('forward','sample','step'):
  s=[v for k,v in d.items() if 'phase=\"'+ph+'\"' in k and '_sum' in k]; c=[v for k,v in d.items() if 'phase=\"'+ph+'\"' in k and '_count' in k]
  if s and c and c[0]: parts.append('%s %.3f ms' % (ph, 1000*s[0]/c[0]))
print('$NAME $c phases:', ', '.join(parts))
import json; d=json.load(open('$OUT/$NAME-$c.json'))['summary']
print('$NAME $c', 'itl median %.2f p99 %.2f' % (d['itl']['median'], d['itl']['p99']), 'ttft %.1f' % d['ttft']['median'], 'done', d['completed'])
"
done
kill $PID; wait $PID 2>/dev/null
