#!/usr/bin/env bash
# Repeatability: run the README's two commands N times with fresh hypothesis seeds (the `dev`
# profile: random examples, a new --hypothesis-seed each round) and print the flakes per test.
#
#   bash scripts/repeat.sh 20                 # both commands, 20 rounds
#   REPEAT_WHAT=meta bash scripts/repeat.sh 5 # only the self-tests (main | meta | both)
#
# A test that failed in some rounds and passed in others is a flake; each is listed with the
# rounds and seeds it failed with (rerun one: pytest NODEID --hypothesis-seed=SEED
# --hypothesis-profile dev). A negative control that fires only sometimes is a defect, never a
# reason to retry. Exit status: 0 when no test failed in any round, 1 otherwise.
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/.."
N=${1:-20}
WHAT=${REPEAT_WHAT:-both}
WORKERS=${REPEAT_WORKERS:-2}
DIR=${REPEAT_DIR:-$(mktemp -d -t conformance-repeat-XXXXXX)}
mkdir -p "$DIR"
unset CI HYPOTHESIS_PROFILE
t0=$(date +%s)
for i in $(seq 1 "$N"); do
  seed=$(( (RANDOM << 15 | RANDOM) + i ))
  echo "$i $seed" >> "$DIR/seeds.txt"
  if [ "$WHAT" != meta ]; then
    pytest -q -n "$WORKERS" --upto C10 --hypothesis-profile dev --hypothesis-seed="$seed" \
      --junitxml="$DIR/main-$i.xml" -p no:warnings > "$DIR/main-$i.log" 2>&1
    echo "round $i/$N main: exit $? ($(tail -n 1 "$DIR/main-$i.log"))"
  fi
  if [ "$WHAT" != main ]; then
    pytest -q -n "$WORKERS" tests_meta --hypothesis-profile dev --hypothesis-seed="$seed" \
      --junitxml="$DIR/meta-$i.xml" -p no:warnings > "$DIR/meta-$i.log" 2>&1
    echo "round $i/$N self-tests: exit $? ($(tail -n 1 "$DIR/meta-$i.log"))"
  fi
done
echo "wall time $(( $(date +%s) - t0 )) s for $N rounds; logs and JUnit XML in $DIR"
python - "$DIR" "$N" <<'EOF'
import collections, glob, os, sys
import xml.etree.ElementTree as ET
d, n = sys.argv[1], int(sys.argv[2])
seeds = dict(line.split() for line in open(os.path.join(d, "seeds.txt")))
failed, runs = collections.defaultdict(list), collections.Counter()
for path in sorted(glob.glob(os.path.join(d, "*-*.xml"))):
    job, rnd = os.path.basename(path)[:-4].rsplit("-", 1)
    for case in ET.parse(path).getroot().iter("testcase"):
        nodeid = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
        runs[(job, nodeid)] += 1
        if case.find("failure") is not None or case.find("error") is not None:
            failed[(job, nodeid)].append(rnd)
flakes = {k: v for k, v in failed.items() if len(v) < runs[k]}
always = {k: v for k, v in failed.items() if len(v) == runs[k]}
print(f"tests seen: {len(runs)}; flakes: {len(flakes)}; failing every round: {len(always)}")
for (job, nodeid), rounds in sorted(flakes.items()):
    print(f"  FLAKE {job} {nodeid}: failed {len(rounds)} of {runs[(job, nodeid)]} rounds "
          f"(seeds {', '.join(seeds[r] for r in rounds)})")
for (job, nodeid), rounds in sorted(always.items()):
    print(f"  FAILS {job} {nodeid}: every round")
sys.exit(1 if failed else 0)
EOF
