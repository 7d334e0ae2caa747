#!/usr/bin/env bash
# The GPU checks, in one command for a CUDA machine: the GPU-only tests, the suite with CUDA
# present, and the GPU benchmarks. Logs go to $OUT (default ./gpu-out), one file per stage.
#
#   bash benchmarks/gpu/gpu_run.sh info tests inner outer swarm mixed suite quality quality-small
#   bash benchmarks/gpu/gpu_run.sh issue49   # issue 49's checks, under 9 minutes (i49-m16: 12 more;
#                                            # i49-ilr: the AdamW part's lr under Muon at 35m, 8 more;
#                                            # i49-moments: M = 8 with sync.average_moments, 7 more)
#
# A machine without our dependencies can take them as wheels in .whl/ (bash benchmarks/gpu/wheels.sh);
# they are installed into /tmp/site first.
set -u
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
if [ -d .whl ] && ! python3 -c "import hivemind" 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1

stage() {  # stage NAME LIMIT_S COMMAND...: run it under a time limit, log it, show its end
    local name=$1 limit=$2
    shift 2
    echo "== $name ($(date +%T))"
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    echo "exit $rc" >> "$OUT/$name.log"
    tail -n "${TAIL:-25}" "$OUT/$name.log"
    return $rc
}

for s in "$@"; do
    case $s in
        info) stage info 60 bash -c 'nvidia-smi; nproc; free -g; python3 -c "import torch, transformers, hivemind;
print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(), transformers.__version__,
hivemind.__version__, torch.cuda.is_bf16_supported(), torch.distributed.is_nccl_available())"' ;;
        tests) stage tests 300 python3 -m pytest -p no:cacheprovider -q -rs tests/gpu ;;
        inner) stage inner 300 python3 benchmarks/gpu/gpu_inner.py --compile ;;
        outer) stage outer 240 python3 benchmarks/gpu/gpu_outer.py ;;
        swarm) stage swarm 300 python3 benchmarks/gpu/gpu_swarm.py ;;
        mixed) stage mixed 180 python3 benchmarks/gpu/gpu_swarm.py --mixed ;;
        suite) stage suite "${SUITE_S:-420}" python3 -m pytest -p no:cacheprovider -q -n 12 --dist loadfile \
                   --timeout 240 ${SUITE_TESTS:-tests/unit tests/integration tests/faults} ;;
        # the quality table at the 35m shape (issue 35), every run of a part at once on the one GPU: a check
        # that a 35m replica trains here (AdamW and Muon), then M = 4 against tuned data-parallel, then
        # data-parallel with Muon inside, then M = 2, each in the time left (--resume: the same JSON); a
        # part's finished runs are in its JSON even if it runs out of time. About 9 minutes on an H200.
        # QUALITY_CORPUS=site trains on this machine's Python sources instead of the embedded corpus.
        quality) end=$((SECONDS + ${QUALITY_S:-540})) muon="opt=muon:mlr=${QUALITY_MLR:-0.008}"
            m4=${QUALITY_M4:-4:recipe=auto 4:recipe=auto:$muon}
            q="python3 benchmarks/quality/quality.py --config configs/35m.yaml --rounds 16 --h 30 --dp-lr 0.002 --jobs 8"
            stage quality-check 120 python3 -m diloco_p2p simulate --order-keys a b --config configs/35m.yaml \
                --dir /tmp/quality-check --set train.max_rounds=1 --set outer.inner_steps=4 --set train.eval_batches=1 \
                --set inner.optimizer=muon --set inner.muon_lr=${QUALITY_MLR:-0.008} || exit 1
            q="$q --set inner.optimizer=adamw"  # the preset's Muon only where a run names it: AdamW is the baseline
            if [ -n "${QUALITY_CORPUS:-}" ]; then  # a corpus larger than the embedded one: the Python sources
                # of QUALITY_CORPUS (a directory; "site": this Python's site-packages), prepared here first
                src=$QUALITY_CORPUS
                [ "$src" = site ] && src=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
                rm -rf /tmp/quality-src && mkdir -p /tmp/quality-src
                (cd "$src" && find . -name '*.py' -size -512k -print0 | tar --null -T - -cf - | tar -xf - -C /tmp/quality-src)
                stage quality-corpus 240 python3 -m diloco_p2p prepare /tmp/quality-src --out /tmp/quality-corpus \
                    --max-bytes $((${QUALITY_CORPUS_MB:-200} << 20)) --quiet || exit 1
                q="$q --set data.path=/tmp/quality-corpus"
            fi
            stage quality-m4 $((end - SECONDS)) $q --dp-scales 0.3536 0.5 0.7071 --json "$OUT/quality_35m.json" --run $m4
            [ $((end - SECONDS)) -gt 30 ] && stage quality-dp-muon $((end - SECONDS)) $q --dp-scales 0.5 --dp-ms 4 \
                --set inner.optimizer=muon --set inner.muon_lr=${QUALITY_MLR:-0.008} --json "$OUT/quality_35m_dp_muon.json"
            [ $((end - SECONDS)) -gt 30 ] && stage quality-m2 $((end - SECONDS)) $q --dp-scales 0.3536 0.5 0.7071 \
                --json "$OUT/quality_35m.json" --resume --run $m4 ${QUALITY_M2:-2:recipe=auto 2:recipe=auto:$muon} ;;
        # `small` over three seeds (issue 35's CPU table, where a CPU needs hours a run): the recipe with
        # Muon and with AdamW inside against data-parallel AdamW (its lr grid) and data-parallel Muon, at
        # QUALITY_SMALL_MS (default 4) and QUALITY_SMALL_ROUNDS (16), each part in the time left (--resume).
        quality-small) end=$((SECONDS + ${QUALITY_SMALL_S:-240})) ms=${QUALITY_SMALL_MS:-4}
            q="python3 benchmarks/quality/quality.py --config configs/small-cpu.yaml --rounds ${QUALITY_SMALL_ROUNDS:-16} --h ${QUALITY_SMALL_H:-30}
               --dp-lr 0.0015 --set inner.lr=0.0015 --jobs ${QUALITY_JOBS:-16} --seeds ${QUALITY_SEEDS:-0 1 2} --dp-ms $ms"
            runs=$(for m in $ms; do echo "$m:recipe=auto:opt=muon:mlr=0.006 $m:recipe=auto"; done)
            stage quality-small $((end - SECONDS)) $q --set inner.optimizer=adamw --dp-scales 0.25 0.3536 0.5 0.7071 \
                --json "$OUT/quality_small_seeds.json" --run $runs
            [ $((end - SECONDS)) -gt 30 ] && stage quality-small-dp-muon $((end - SECONDS)) $q --set inner.optimizer=muon \
                --set inner.muon_lr=0.006 --dp-scales 0.5 0.7071 1.0 --json "$OUT/quality_small_seeds_dp_muon.json" ;;
        # Issue 49 in one call of under 9 minutes: the GPU tests (35 s on an H200), then at once the 35m table
        # at M = 8 against data-parallel Muon at equal tokens (data-parallel batch 64, replicas of 8, one lr
        # each) and a long horizon (64 rounds) on small at M = 4 as the preset ships it (Muon, inner.lr 2.4e-2;
        # data-parallel at that lr and 2x), each within I49_Q_S (420 s). Measured on an
        # H200 (2026-11-28): the M = 8 DiLoCo run takes 326 s, since the simulator steps its replicas one
        # after another at batch 8; M = 16 needs about twice that, so it is its own stage, i49-m16, for a
        # session with 12 minutes of device time. I49_* shrink it (a CPU check of the plumbing:
        # I49_CONFIG=configs/tiny-cpu.yaml I49_ROUNDS=2 I49_H=2 I49_LONG_CONFIG=configs/tiny-cpu.yaml
        # I49_LONG_ROUNDS=3 I49_LONG_H=2 I49_JOBS=1).
        # i49-moments: issue49's M = 8 table with sync.average_moments (the inner first moments averaged after
        # each round, twice the bytes), its own data-parallel runs again; about 7 minutes (not run on a GPU yet).
        issue49|i49-m16|i49-moments) mlr=${QUALITY_MLR:-0.008} limit=${I49_Q_S:-420}
            q="python3 benchmarks/quality/quality.py --config ${I49_CONFIG:-configs/35m.yaml} --rounds ${I49_ROUNDS:-16}
               --h ${I49_H:-30} --dp-lr 0.002 --dp-scales 0.5 --jobs ${I49_JOBS:-8} --set inner.optimizer=muon
               --set inner.muon_lr=$mlr"
            if [ "$s" = i49-m16 ]; then
                stage i49-35m-m16 "${I49_M16_S:-700}" $q --batch 4 --json "$OUT/i49_35m_m16.json" \
                    --run "16:recipe=auto:opt=muon:mlr=$mlr"
                continue
            fi
            if [ "$s" = i49-moments ]; then
                stage i49-35m-moments "${I49_MOMENTS_S:-480}" $q --batch 8 --json "$OUT/i49_35m_moments.json" \
                    --run "8:recipe=auto:opt=muon:mlr=$mlr:moments"
                continue
            fi
            stage i49-tests "${I49_TESTS_S:-120}" python3 -m pytest -p no:cacheprovider -q -rs ${I49_TESTS:-tests/gpu}
            stage i49-35m-m8 "$limit" $q --batch 8 --json "$OUT/i49_35m_m8.json" \
                --run "8:recipe=auto:opt=muon:mlr=$mlr" &
            stage i49-long-small "$limit" python3 benchmarks/quality/quality.py --config \
                ${I49_LONG_CONFIG:-configs/small-cpu.yaml} --rounds ${I49_LONG_ROUNDS:-64} --h ${I49_LONG_H:-10} \
                --dp-scales 0.5 0.7071 --jobs ${I49_JOBS:-8} --json "$OUT/i49_long_small.json" --run 4:recipe=auto &
            wait ;;
        # The AdamW part's lr under Muon (inner.lr: embeddings, head, norms) at the 35m shape: on tiny its best was
        # 32x the preset's (0.048 against 0.0015) for data-parallel and DiLoCo alike. Data-parallel Muon at M = 1
        # over a 4x grid, then M = 8 at the square-root rule from its best, and DiLoCo M = 8 (the recipe) at
        # inner.lr 16x. About 8 minutes on an H200 (estimated from issue49's runs; not run on a GPU yet).
        i49-ilr) mlr=${QUALITY_MLR:-0.008}
            stage i49-35m-ilr "${I49_ILR_S:-540}" python3 benchmarks/quality/quality.py --config \
                ${I49_CONFIG:-configs/35m.yaml} --rounds ${I49_ROUNDS:-16} --h ${I49_H:-30} --batch 8 \
                --dp-lr ${I49_ILR_GRID:-0.002 0.008 0.032} --dp-scales 0.5 --jobs ${I49_JOBS:-8} \
                --set inner.optimizer=muon --set inner.muon_lr=$mlr --json "$OUT/i49_35m_ilr.json" \
                --run "8:recipe=auto:opt=muon:mlr=$mlr:ilr=${I49_ILR:-0.032}" ;;
        *) echo "unknown stage $s"; exit 2 ;;
    esac
done
