#!/usr/bin/env bash
# The heavy frameworks, PyTorch (the PyPI CUDA 12.8 build), TensorFlow (tensorflow[and-cuda]) and
# JAX (jax[cuda12]), unmodified,
# under libcuvisor on the simulated GPU. Not part of CI: the wheels are about 3 GB per framework
# (downloaded once into target/ci-tools/, git-ignored; later runs reuse them) and need network
# the first time only. No GPU is needed: everything runs on the simulator (crates/sim).
#
# Each probe runs as `cuvisor run --memory 6Gi --sim single -- python <probe>`:
#   - scripts/frameworks/torch_probe.py once per allocator (PYTORCH_CUDA_ALLOC_CONF unset,
#     expandable_segments:True, backend:cudaMallocAsync): is_available, mem_get_info total ==
#     quota, 0.3/0.5/0.8/1.0 x quota as one tensor each (freed between), 1.2 x quota raising
#     torch.OutOfMemoryError, elementwise ops, a cuBLAS matmul;
#   - scripts/frameworks/tf_probe.py: examples/tf_stress/tf_stress.py as it is, with TensorFlow's
#     BFC allocator (memory growth on) and with cuda_malloc_async: the total is the quota,
#     0.3/0.5/0.8/1.0 of what is free as one tensor each (a fresh process each), 1.2 refused with
#     a clean ResourceExhaustedError;
#   - scripts/frameworks/jax_probe.py: the default preallocation (0.75) is of the quota, not of
#     the GPU; an allocation beyond it fails cleanly and JAX goes on.
# The simulator runs no kernel code: launches are checked to run, never their results.
# JAX is changed in one place: it looks for /dev/nvidia0 or /dev/nvidiactl before it tries its
# CUDA plugin, and the simulator has no device files, so the probe answers that check (a NOTE row).
# On 2026-12-01 every row passed (or is a NOTE), cuBLAS matmuls included, and on 2026-12-02 every
# TensorFlow row; see docs/frameworks.md.
# Prints one table (client, check, PASS/FAIL/NOTE, what was measured), then what the simulator
# logged as unsupported (its 'cuvisor-sim' lines); exit 0 iff no row is FAIL.
#
# libcuvisor.so, the cuvisor CLI and the simulated libcuda/libnvidia-ml: from
# `cargo build --release -p cuvisor -p cuvisor-cli -p cuvisor-sim-cuda -p cuvisor-sim-nvml` into
# this repo's target/release,
# or, without building, from the cargo profile directory $CUVISOR_TARGET_DIR (e.g.
# /path/to/checkout/target/debug, holding cuvisor, deps/libcuvisor.so and sim/).
#
# --bench: instead, what interception costs PyTorch (scripts/frameworks/torch_overhead.py, a loop
# of small elementwise ops and cached allocations, on a GPU whose kernels take 100 ns so that
# the loop is bound by the CPU, where interception costs): run on the simulator directly and
# under `cuvisor run` in turns, best of each; the bar is 2 %.
#
# --set newest: the newest releases instead of the pinned set: PyTorch 2.15 (the default PyPI
# build, CUDA 13.2), the torch probe under `cuvisor run` with each allocator and once on the
# simulator directly (no libcuvisor: the quota is the GPU's memory). Its first allocation failed
# with "named symbol not found" until the simulator resolved every driver entry point PyTorch
# 2.15's allocator looks up at start (docs/simulator.md, "PyTorch 2.15"). On 2026-12-03 all 44
# rows of the newest set passed (or are a NOTE), cuBLAS matmuls included, under each allocator and
# directly on the simulator (where its context takes the preset's 322 MiB).
#
# Usage: scripts/frameworks.sh [--set pinned|newest] [--only torch|tf|jax] [--memory SIZE] [--timeout S] [--keep] [--bench]
set -euo pipefail

usage() {
    sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'
    cat <<'EOT'
Options:
  --set pinned|newest  the pinned set (default: PyTorch 2.8, TensorFlow 2.20, JAX 0.7.1) or the
                    newest (PyTorch 2.15 only)
  --only torch|tf|jax  run one framework only (default: all three)
  --memory SIZE     the quota, as `cuvisor run --memory` takes it (default 6Gi)
  --timeout S       seconds each probe may take (default 900)
  --keep            keep the logs directory (default: kept only when a row failed)
  --bench           measure what interception adds to a PyTorch loop instead of the checks
Environment:
  CUVISOR_TARGET_DIR  a cargo profile directory to take the binaries from instead of building
  PYTHON              the python3 that creates the venvs (default python3, 3.11 to 3.13)
EOT
}

# --- pinned wheels ----------------------------------------------------------------------------
# The whole set as pip resolved it (torch and jax pin their NVIDIA wheels exactly themselves; the
# rest is pinned here), so that an install is the same every time.
TORCH_VENV=torch-2.8.0-cu128
TORCH_WHEELS=(
    filelock==4.3.1 fsspec==2026.9.0 Jinja2==3.1.6 MarkupSafe==3.0.4 mpmath==1.3.0 networkx==3.6.1
    nvidia-cublas-cu12==12.8.4.1 nvidia-cuda-cupti-cu12==12.8.90 nvidia-cuda-nvrtc-cu12==12.8.93
    nvidia-cuda-runtime-cu12==12.8.90 nvidia-cudnn-cu12==9.10.2.21 nvidia-cufft-cu12==11.3.3.83
    nvidia-cufile-cu12==1.13.1.3 nvidia-curand-cu12==10.3.9.90 nvidia-cusolver-cu12==11.7.3.90
    nvidia-cusparse-cu12==12.5.8.93 nvidia-cusparselt-cu12==0.7.1 nvidia-nccl-cu12==2.27.3
    nvidia-nvjitlink-cu12==12.8.93 nvidia-nvtx-cu12==12.8.90 sympy==1.14.0 torch==2.8.0
    triton==3.4.0 typing_extensions==4.16.0
)
TF_VENV=tensorflow-2.20.0-cuda12
TF_WHEELS=(
    absl-py==2.5.1 astunparse==1.6.3 certifi==2026.10.19.post1 charset-normalizer==3.5.3
    flatbuffers==25.12.19 gast==0.7.0 google-pasta==0.2.0 grpcio==1.85.3 h5py==3.16.0 idna==3.20
    keras==3.15.1 libclang==18.1.1 Markdown==3.11.3 markdown-it-py==4.3.0 MarkupSafe==3.0.4
    mdurl==0.1.2 ml_dtypes==0.7.0 namex==0.1.0 numpy==2.4.6 nvidia-cublas-cu12==12.9.3.13
    nvidia-cuda-cupti-cu12==12.9.79 nvidia-cuda-nvcc-cu12==12.9.86 nvidia-cuda-nvrtc-cu12==12.9.86
    nvidia-cuda-runtime-cu12==12.9.79 nvidia-cudnn-cu12==9.28.0.42 nvidia-cufft-cu12==11.4.1.4
    nvidia-curand-cu12==10.3.10.19 nvidia-cusolver-cu12==11.7.5.82 nvidia-cusparse-cu12==12.5.10.65
    nvidia-nccl-cu12==2.32.3 nvidia-nvjitlink-cu12==12.9.86 opt_einsum==3.4.0 optree==0.20.0
    packaging==26.4 pillow==13.0.0 protobuf==7.36.2 Pygments==2.21.0 requests==2.34.2 rich==15.0.0
    six==1.17.0 tensorboard==2.20.0 tensorboard-data-server==0.7.2 tensorflow==2.20.0
    termcolor==3.3.0 typing_extensions==4.16.0 urllib3==2.8.0 Werkzeug==3.1.9 wrapt==2.5.2
)
# The newest set: PyTorch 2.15.0 (CUDA 13.2) as pip resolved it on 2026-12-03.
TORCH_NEWEST_VENV=torch-2.15.0-cu132
TORCH_NEWEST_WHEELS=(
    cuda-bindings==13.5.0 cuda-pathfinder==1.9.1 cuda-toolkit==13.2.2 filelock==4.3.2
    fsspec==2026.9.0 Jinja2==3.1.6 MarkupSafe==3.0.4 mpmath==1.3.0 networkx==3.6.1 numpy==2.4.6
    nvidia-cublas==13.4.1.3 nvidia-cuda-cccl==13.3.5.0.6 nvidia-cuda-cupti==13.2.86
    nvidia-cuda-nvrtc==13.2.86 nvidia-cuda-runtime==13.2.86 nvidia-cudnn-cu13==9.26.0.51
    nvidia-cufft==12.2.0.57 nvidia-cufile==1.17.1.22 nvidia-cusolver==12.2.0.11
    nvidia-cusparse==12.7.10.12 nvidia-cusparselt-cu13==0.8.1 nvidia-nccl-cu13==2.30.7
    nvidia-nvjitlink==13.5.37 nvidia-nvshmem-cu13==3.7.2 nvidia-nvtx==13.2.86 setuptools==84.2.1
    sympy==1.14.0 torch==2.15.0 triton==3.9.0 typing_extensions==4.16.0
)
JAX_VENV=jax-0.7.1-cuda12
JAX_WHEELS=(
    jax==0.7.1 jax-cuda12-pjrt==0.7.1 jax-cuda12-plugin==0.7.1 jaxlib==0.7.1 ml_dtypes==0.7.0
    numpy==2.4.6 nvidia-cublas-cu12==12.9.3.13 nvidia-cuda-cccl-cu12==12.9.27
    nvidia-cuda-cupti-cu12==12.9.79 nvidia-cuda-nvcc-cu12==12.9.86 nvidia-cuda-nvrtc-cu12==12.9.86
    nvidia-cuda-runtime-cu12==12.9.79 nvidia-cudnn-cu12==9.28.0.42 nvidia-cufft-cu12==11.4.1.4
    nvidia-cusolver-cu12==11.7.5.82 nvidia-cusparse-cu12==12.5.10.65 nvidia-nccl-cu12==2.32.3
    nvidia-nvjitlink-cu12==12.9.86 nvidia-nvshmem-cu12==3.8.0 opt_einsum==3.4.0 scipy==1.17.1
)

die() {
    echo "frameworks: $*" >&2
    exit 2
}

only=
set=pinned
memory=6Gi
per_probe_timeout=900
keep=0
bench=0
while (($#)); do
    case $1 in
        --set) set=${2:?--set needs pinned or newest}; shift 2 ;;
        --only) only=${2:?--only needs torch, tf or jax}; shift 2 ;;
        --memory) memory=${2:?--memory needs a size}; shift 2 ;;
        --timeout) per_probe_timeout=${2:?--timeout needs seconds}; shift 2 ;;
        --keep) keep=1; shift ;;
        --bench) bench=1; shift ;;
        -h | --help) usage; exit 0 ;;
        *) usage >&2; exit 2 ;;
    esac
done
case $only in "" | torch | tf | jax) ;; *) die "--only takes torch, tf or jax, not $only" ;; esac
case $set in
    pinned) ;;
    newest)
        [[ -z $only || $only == torch ]] || die "the newest set has PyTorch only (--only torch)"
        only=torch
        TORCH_VENV=$TORCH_NEWEST_VENV
        TORCH_WHEELS=("${TORCH_NEWEST_WHEELS[@]}")
        ;;
    *) die "--set takes pinned or newest, not $set" ;;
esac

repo=$(cd "$(dirname "$0")/.." && pwd)
probes=$repo/scripts/frameworks
tools=$repo/target/ci-tools
python=${PYTHON:-python3}

# --- the binaries -----------------------------------------------------------------------------
if [[ -n ${CUVISOR_TARGET_DIR:-} ]]; then
    bin=$(cd "$CUVISOR_TARGET_DIR" && pwd)
else
    # Release builds: a debug libcuvisor and simulator cost a framework several % by themselves.
    echo "frameworks: cargo build --release -p cuvisor -p cuvisor-cli -p cuvisor-sim-cuda -p cuvisor-sim-nvml" >&2
    (cd "$repo" && cargo build -q --release -p cuvisor -p cuvisor-cli -p cuvisor-sim-cuda -p cuvisor-sim-nvml) ||
        die "the build failed"
    bin=$repo/target/release
fi
cuvisor=$bin/cuvisor
lib=$bin/deps/libcuvisor.so
[[ -f $lib ]] || lib=$bin/libcuvisor.so
for f in "$cuvisor" "$lib" "$bin/sim/libcuda.so.1" "$bin/sim/libnvidia-ml.so.1"; do
    [[ -e $f ]] || die "$f is missing (build it, or point CUVISOR_TARGET_DIR at a profile directory that has it)"
done

# --- the venvs --------------------------------------------------------------------------------
# target/ci-tools/<name>/, installed once: beside its place first and renamed into it, so that an
# interrupted install is never taken for a finished one.
venv() {
    local name=$1
    shift
    local dir=$tools/$name
    if [[ -e $dir/installed ]]; then
        echo "$dir"
        return
    fi
    local tmp=$tools/$name.tmp-$$
    rm -rf "$tmp"
    mkdir -p "$tools"
    echo "frameworks: installing $name into $dir (about 3 GB the first time)" >&2
    "$python" -m venv "$tmp" >&2 || die "$python -m venv failed"
    "$tmp/bin/pip" install --quiet --disable-pip-version-check --no-deps "$@" >&2 ||
        { rm -rf "$tmp"; die "pip could not install $name: $*"; }
    touch "$tmp/installed"
    rm -rf "$dir"
    mv "$tmp" "$dir"
    echo "$dir"
}

logs=$(mktemp -d "${TMPDIR:-/tmp}/cuvisor-frameworks.XXXXXX")
rows=$logs/rows

# probe TAG VENV SCRIPT [VAR=VALUE | -u VAR ...]: one probe under cuvisor run; its FWCHECK rows
# go to $rows, and a probe that dies or prints no row adds a FAIL row saying where it stopped.
probe() {
    local tag=$1 venv=$2 script=$3
    shift 3
    local log=$logs/$tag
    echo "frameworks: $tag ..." >&2
    local rc=0
    timeout --kill-after=10 "$per_probe_timeout" \
        "$cuvisor" run --memory "$memory" --sim single --library "$lib" -- \
        env "$@" "$venv/bin/python" "$probes/$script" >"$log.out" 2>"$log.err" || rc=$?
    grep $'^FWCHECK\t' "$log.out" | cut -f2- >>"$rows" || true
    if ((rc != 0)); then
        local why
        why=$(grep -v '^\s*$' "$log.err" | grep -v '^cuvisor-sim' | tail -n 1 | cut -c1-200 || true)
        ((rc == 124)) && why="timed out after ${per_probe_timeout}s; $why"
        printf '%s\tprocess exits 0\tFAIL\texit %s: %s (log %s.err)\n' "$tag" "$rc" "$why" "$log" >>"$rows"
    fi
}

# direct TAG VENV SCRIPT [VAR=VALUE | -u VAR ...]: as `probe`, on the simulator's single preset
# without libcuvisor (CUVISOR_MEMORY_LIMIT unset: the probe takes the GPU's memory as the quota).
direct() {
    local tag=$1 venv=$2 script=$3
    shift 3
    local log=$logs/$tag
    echo "frameworks: $tag ..." >&2
    local rc=0
    timeout --kill-after=10 "$per_probe_timeout" \
        env -u CUVISOR_MEMORY_LIMIT "$@" LD_LIBRARY_PATH="$bin/sim" CUVISOR_SIM=single \
        CUVISOR_SIM_STATE="$logs/$tag.state" "$venv/bin/python" "$probes/$script" \
        >"$log.out" 2>"$log.err" || rc=$?
    grep $'^FWCHECK\t' "$log.out" | cut -f2- | sed "s/^/direct: /" >>"$rows" || true
    if ((rc != 0)); then
        local why
        why=$(grep -v '^\s*$' "$log.err" | grep -v '^cuvisor-sim' | tail -n 1 | cut -c1-200 || true)
        ((rc == 124)) && why="timed out after ${per_probe_timeout}s; $why"
        printf '%s\tprocess exits 0\tFAIL\texit %s: %s (log %s.err)\n' "$tag" "$rc" "$why" "$log" >>"$rows"
    fi
}

if ((bench)); then
    tv=$(venv "$TORCH_VENV" "${TORCH_WHEELS[@]}")
    # On the single preset's GPU with 100 ns kernels (the preset's 10 us would make the loop
    # wait on the simulated GPU, and the figure say nothing about the CPU side, where
    # interception costs). Alternated, a fresh process (and simulated GPU) each time; the best
    # of each side.
    model=$logs/bench.toml
    cat >"$model" <<'EOT'
default_kernel_ns = 100
[[device]]
name = "NVIDIA A100-PCIE-16GB"
memory = "16Gi"
compute_capability = "8.0"
EOT
    best_direct= best_hooked=
    for round in 1 2 3 4; do
        state=$logs/direct-$round.state
        d=$(env LD_LIBRARY_PATH="$bin/sim" CUVISOR_SIM="$model" CUVISOR_SIM_STATE="$state" \
            "$tv/bin/python" "$probes/torch_overhead.py" 2>>"$logs/bench.err" | awk '/^BENCH/ {print $2}')
        h=$("$cuvisor" run --memory "$memory" --sim "$model" --library "$lib" -- \
            "$tv/bin/python" "$probes/torch_overhead.py" 2>>"$logs/bench.err" | awk '/^BENCH/ {print $2}')
        [[ -n $d && -n $h ]] || die "the bench did not run (see $logs/bench.err)"
        echo "frameworks: round $round: direct $d ns/iteration, hooked $h ns/iteration" >&2
        [[ -z $best_direct || $d -lt $best_direct ]] && best_direct=$d
        [[ -z $best_hooked || $h -lt $best_hooked ]] && best_hooked=$h
    done
    awk -v d="$best_direct" -v h="$best_hooked" 'BEGIN {
        pct = (h - d) * 100 / d
        printf "PyTorch loop (3 elementwise kernels of 100 ns + a cached allocation per iteration), best of 4 processes x 15 rounds x 2000 iterations:\n"
        printf "  direct %d ns/iteration, under cuvisor run %d ns/iteration: %+.2f %% (target <= 2 %%): %s\n", d, h, pct, (pct <= 2 ? "PASS" : "FAIL")
        exit (pct <= 2 ? 0 : 1)
    }'
    rc=$?
    rm -rf "$logs"
    exit $rc
fi

if [[ -z $only || $only == torch ]]; then
    tv=$(venv "$TORCH_VENV" "${TORCH_WHEELS[@]}")
    probe torch-native "$tv" torch_probe.py -u PYTORCH_CUDA_ALLOC_CONF
    probe torch-expandable "$tv" torch_probe.py PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
    probe torch-async "$tv" torch_probe.py PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync
    if [[ $set == newest ]]; then
        # The same checks on the simulator alone: what PyTorch does there is what libcuvisor
        # has to keep, so a FAIL here is the simulator's, not libcuvisor's.
        direct torch-direct "$tv" torch_probe.py -u PYTORCH_CUDA_ALLOC_CONF
    fi
fi
if [[ -z $only || $only == tf ]]; then
    fv=$(venv "$TF_VENV" "${TF_WHEELS[@]}")
    probe tensorflow "$fv" tf_probe.py -u TF_GPU_ALLOCATOR
fi
if [[ -z $only || $only == jax ]]; then
    jv=$(venv "$JAX_VENV" "${JAX_WHEELS[@]}")
    probe jax "$jv" jax_probe.py -u XLA_PYTHON_CLIENT_PREALLOCATE -u XLA_PYTHON_CLIENT_MEM_FRACTION \
        -u XLA_PYTHON_CLIENT_ALLOCATOR
fi

# --- the table --------------------------------------------------------------------------------
touch "$rows"
echo
echo "cuvisor run --memory $memory --sim single; library $lib; set $set"
awk -F'\t' '
    { c[NR] = $1; k[NR] = $2; v[NR] = $3; m[NR] = $4
      if (length($1) > w1) w1 = length($1); if (length($2) > w2) w2 = length($2) }
    END {
        if (w1 < 6) w1 = 6; if (w2 < 5) w2 = 5
        printf "%-" w1 "s  %-" w2 "s  %-6s  %s\n", "CLIENT", "CHECK", "RESULT", "MEASURED"
        for (i = 1; i <= NR; i++) printf "%-" w1 "s  %-" w2 "s  %-6s  %s\n", c[i], k[i], v[i], m[i]
    }' "$rows"
sim=$(cat "$logs"/*.err 2>/dev/null | grep '^cuvisor-sim' | sort | uniq -c | sort -rn || true)
if [[ -n $sim ]]; then
    echo
    echo "The simulator logged (count, line):"
    echo "$sim" | head -n 40
fi
failed=$(awk -F'\t' '$3 == "FAIL"' "$rows" | wc -l)
total=$(wc -l <"$rows")
echo
if ((failed == 0 && total > 0)); then
    echo "frameworks: all $total rows PASS or NOTE"
    ((keep)) && echo "frameworks: logs in $logs" || rm -rf "$logs"
    exit 0
fi
echo "frameworks: $failed of $total rows FAIL; logs in $logs"
exit 1
