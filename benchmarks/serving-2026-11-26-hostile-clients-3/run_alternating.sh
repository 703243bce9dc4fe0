#!/bin/bash
# main and the branch alternating, three times: the hostile probe's bursts, senders at nice 19.
# BASE_TREE: a `git archive` of main with this branch's scripts/serving/{hostile_probe,sink}.py
# copied in; BRANCH_TREE: the branch's checkout; MODEL: the tiny chat model directory;
# OUT: where the runs' output goes; PYTHON: the project's venv interpreter.
set -u
for i in 1 2 3; do
  for t in base branch; do
    if [ "$t" = base ]; then tree=$BASE_TREE; else tree=$BRANCH_TREE; fi
    f=$OUT/$t-nice19-$i.txt
    echo "# $t run $i, start $(date -u +%H:%M:%S), $(uptime)" > "$f"
    (cd "$tree" && PYTHONPATH="$tree" timeout 600 "$PYTHON" -m scripts.serving.hostile_probe \
      --bursts-only --sender-nice 19 --model "$MODEL" --log "$OUT/$t-$i.log" >> "$f" 2>&1)
    echo "# end $(date -u +%H:%M:%S), $(uptime)" >> "$f"
    rm -f "$OUT/$t-$i.log"
  done
done
