#!/usr/bin/env bash
# cuvisor on a real NVIDIA GPU: one short run (a few minutes at most) on a machine with the
# NVIDIA driver, PyTorch and JAX installed and no network.
#
# Under a quota (default 4Gi) on one GPU, each check in its own process with libcuvisor.so
# preloaded and a fresh ledger directory:
#   - PyTorch's native allocator, expandable_segments:True and backend:cudaMallocAsync each stop
#     at the quota with a clean torch.OutOfMemoryError (chunks until OOM: 90-100 % of the quota
#     allocated, never more) and go on allocating afterwards;
#   - torch.cuda.mem_get_info() and the device properties show the quota as total memory;
#   - JAX, preallocating with its defaults (75 %), takes 75 % of the quota, not of the card;
#   - the driver-level tf_stress twin (examples/tf_stress/twin.c), both ways into the driver.
# Prints one table (check, expected, observed, PASS/FAIL); exit 0 iff every row passed.
# Any NVIDIA GPU will do; the machine it is prepared for has NVIDIA H200s (nvidia-smi: "NVIDIA
# H200", 143771MiB each), which the simulator's `h200` preset models (docs/simulator.md).
#
# The library: --lib FILE or $CUVISOR_LIB, else a build in target/release/ (carried along, or
# left by an earlier build), else `cargo build --release --offline -p cuvisor`; --build forces
# the build. The Python checks are in scripts/gpu_check_probe.py.
#
# Usage: scripts/gpu-check.sh [--quota SIZE] [--device N] [--lib FILE] [--build] [--timeout S]
#                             [--keep] [--dry-run]
set -euo pipefail

usage() {
    sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'
    cat <<'EOF'
Options:
  --quota SIZE   quota for the GPU: plain bytes or Ki/Mi/Gi/Ti (default 4Gi)
  --device N     which GPU (CUDA_VISIBLE_DEVICES for every check; default 0)
  --lib FILE     libcuvisor.so to test (default: $CUVISOR_LIB, else target/release, else build)
  --build        build the library with cargo even if a build is there
  --timeout S    seconds each check may take (default 240)
  --keep         keep the work directory (logs, state) even when everything passed
  --dry-run      print the commands instead of running them
EOF
}

die() {
    echo "gpu-check: $*" >&2
    exit 2
}

quota_text=4Gi
device=0
lib=${CUVISOR_LIB:-}
build=0
per_check_timeout=240
keep=0
dry_run=0
while (($#)); do
    case $1 in
        --quota) quota_text=${2:?--quota needs a size}; shift 2 ;;
        --device) device=${2:?--device needs a GPU index}; shift 2 ;;
        --lib) lib=${2:?--lib needs a file}; shift 2 ;;
        --build) build=1; shift ;;
        --timeout) per_check_timeout=${2:?--timeout needs seconds}; shift 2 ;;
        --keep) keep=1; shift ;;
        --dry-run) dry_run=1; shift ;;
        -h | --help) usage; exit 0 ;;
        *) usage >&2; exit 2 ;;
    esac
done

# "4Gi" -> 4294967296. Integers only: a quota is a whole number of bytes, KiB, MiB, ...
to_bytes() {
    local text=$1 number unit
    [[ $text =~ ^([0-9]+)(Ki|Mi|Gi|Ti)?$ ]] || die "--quota $text: use plain bytes or a whole number of Ki, Mi, Gi or Ti"
    number=${BASH_REMATCH[1]}
    unit=${BASH_REMATCH[2]}
    case $unit in
        Ki) echo $((number << 10)) ;;
        Mi) echo $((number << 20)) ;;
        Gi) echo $((number << 30)) ;;
        Ti) echo $((number << 40)) ;;
        *) echo "$number" ;;
    esac
}
quota=$(to_bytes "$quota_text")
((quota > 0)) || die "--quota must be more than 0 bytes"
[[ $device =~ ^[0-9]+$ ]] || die "--device takes a GPU index"
[[ $per_check_timeout =~ ^[0-9]+$ ]] || die "--timeout takes seconds"
quota_mib=$(awk -v q="$quota" 'BEGIN { printf "%.0f", q / 1048576 }')

repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo"

# Prints a command as a shell would read it back.
show() {
    printf '%q ' "$@"
    printf '\n'
}

# --- the library -------------------------------------------------------------------------------
if [[ -z $lib ]]; then
    if ((build == 0)); then
        for candidate in target/release/deps/libcuvisor.so target/release/libcuvisor.so; do
            if [[ -f $candidate ]]; then
                lib=$candidate
                break
            fi
        done
    fi
    if [[ -z $lib ]]; then
        build_cmd=(cargo build --release --offline -p cuvisor)
        if ((dry_run)); then
            show "${build_cmd[@]}"
        else
            echo "gpu-check: building the library: ${build_cmd[*]}" >&2
            "${build_cmd[@]}" >&2 || die "building libcuvisor.so failed (no build to carry? give --lib FILE)"
        fi
        lib=target/release/deps/libcuvisor.so
    fi
fi
if ((dry_run == 0)); then
    [[ -f $lib ]] || die "$lib: no such file"
fi
if [[ -d $(dirname "$lib") ]]; then
    lib=$(cd "$(dirname "$lib")" && pwd)/$(basename "$lib")
fi

# --- where logs and ledgers go -----------------------------------------------------------------
if ((dry_run)); then
    work=/tmp/cuvisor-gpu-check.DRYRUN
else
    work=$(mktemp -d "${TMPDIR:-/tmp}/cuvisor-gpu-check.XXXXXX")
fi

# The environment of every check: the library, the quota, one GPU, nothing inherited that would
# change how PyTorch or JAX allocate (each check sets what it tests).
check_env() { # STATE_DIR
    printf '%s\n' env -u CUVISOR_CONFIG -u PYTORCH_CUDA_ALLOC_CONF \
        -u XLA_PYTHON_CLIENT_PREALLOCATE -u XLA_PYTHON_CLIENT_MEM_FRACTION \
        -u XLA_PYTHON_CLIENT_ALLOCATOR -u TF_GPU_ALLOCATOR \
        "LD_PRELOAD=$lib" "CUVISOR_MEMORY_LIMIT=$quota" "CUVISOR_STATE_DIR=$1" \
        "CUDA_VISIBLE_DEVICES=$device" "CUVISOR_LOG=warn"
}

names=()
expects=()
observeds=()
verdicts=()
add_row() { # NAME EXPECTED OBSERVED VERDICT
    names+=("$1")
    expects+=("$2")
    observeds+=("$3")
    verdicts+=("$4")
}

# Runs one check in its own process: CHECK_NAME, then the command (after the common environment
# and a fresh state directory). Output goes to <work>/<slug>.log; the row comes from the last
# GPUCHECK line (Python checks) or from the caller (see run_twin).
last_log=
last_status=0
run_in_env() { # SLUG COMMAND...
    local slug=$1 state
    shift
    state=$work/$slug.state
    local -a cmd
    mapfile -t cmd < <(check_env "$state")
    cmd+=(timeout "$per_check_timeout" "$@")
    last_log=$work/$slug.log
    if ((dry_run)); then
        show "${cmd[@]}"
        last_status=0
        return
    fi
    mkdir -p "$state"
    last_status=0
    "${cmd[@]}" >"$last_log" 2>&1 || last_status=$?
}

# What to show when a check ended without its row: how it ended and its last line of output.
crash_text() {
    local how="exit $last_status"
    ((last_status == 124)) && how="timed out after ${per_check_timeout}s"
    ((last_status > 128 && last_status != 124)) && how="killed by signal $((last_status - 128))"
    printf '%s: %s' "$how" "$(grep -v '^GPUCHECK' "$last_log" | tail -n 1 | cut -c1-80 || true)"
}

run_probe() { # NAME SLUG CHECK [VAR=VALUE...]
    local name=$1 slug=$2 check=$3
    shift 3
    if ! command -v python3 >/dev/null; then
        add_row "$name" "-" "python3 not found" FAIL
        return
    fi
    run_in_env "$slug" env "$@" python3 scripts/gpu_check_probe.py "$check" "$quota"
    ((dry_run)) && return
    local line
    line=$(grep '^GPUCHECK' "$last_log" | tail -n 1 || true)
    if [[ -z $line ]]; then
        add_row "$name" "(a row from the probe)" "$(crash_text)" FAIL
        return
    fi
    local _tag expected observed verdict
    IFS=$'\t' read -r _tag expected observed verdict <<<"$line"
    add_row "$name" "$expected" "$observed" "$verdict"
}

twin=$work/tf_stress_twin
build_twin() {
    local -a cc_cmd=(cc -O2 -Wall -o "$twin" examples/tf_stress/twin.c -ldl)
    if ((dry_run)); then
        show "${cc_cmd[@]}"
        return 0
    fi
    command -v cc >/dev/null || return 1
    "${cc_cmd[@]}" >"$work/twin-build.log" 2>&1
}

run_twin() { # NAME SLUG RESOLVE
    local name=$1 slug=$2 resolve=$3
    local expected="total ${quota_mib} MiB; <=1.0 ok, 1.2 OOM, goes on"
    run_in_env "$slug" "$twin" --resolve "$resolve"
    ((dry_run)) && return
    local header verdict_line observed
    header=$(grep -o 'total [0-9]* MiB, free [0-9]* MiB' "$last_log" | head -n 1 || true)
    verdict_line=$(grep -E '^twin: (PASS|FAIL)' "$last_log" | tail -n 1 || true)
    if [[ -z $verdict_line ]]; then
        add_row "$name" "$expected" "$(crash_text)" FAIL
        return
    fi
    observed="$header; twin says ${verdict_line#twin: }"
    if ((last_status != 0)); then
        observed="$header; $(grep -m 1 'FAIL' "$last_log" | cut -c1-70 || true)"
    fi
    if ((last_status == 0)) && [[ $header == "total ${quota_mib} MiB,"* ]]; then
        add_row "$name" "$expected" "$observed" PASS
    else
        add_row "$name" "$expected" "$observed" FAIL
    fi
}

# --- the checks --------------------------------------------------------------------------------
gpu_name=unknown
if ((dry_run == 0)) && command -v nvidia-smi >/dev/null; then
    gpu_name=$(env -u LD_PRELOAD nvidia-smi -i "$device" --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null || echo unknown)
fi

run_probe "torch: native allocator" torch-native torch-fill
run_probe "torch: expandable_segments" torch-expandable torch-fill PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
run_probe "torch: cudaMallocAsync" torch-async torch-fill PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync
run_probe "torch: mem_get_info" torch-meminfo torch-meminfo
run_probe "torch: device total_memory" torch-props torch-props
run_probe "jax: preallocation (75%)" jax jax-prealloc
if build_twin; then
    run_twin "twin (cuGetProcAddress_v2)" twin-procaddress procaddress
    run_twin "twin (dlsym)" twin-dlsym dlsym
else
    add_row "twin" "builds with cc" "cc failed or missing (see $work/twin-build.log)" FAIL
fi

if ((dry_run)); then
    exit 0
fi

# --- the table ---------------------------------------------------------------------------------
failed=0
w1=5 w2=8 w3=8
for i in "${!names[@]}"; do
    ((${#names[$i]} > w1)) && w1=${#names[$i]}
    ((${#expects[$i]} > w2)) && w2=${#expects[$i]}
    ((${#observeds[$i]} > w3)) && w3=${#observeds[$i]}
done
echo
echo "cuvisor gpu-check: GPU $device ($gpu_name), quota $quota_text = $quota bytes, library $lib"
printf "%-${w1}s  %-${w2}s  %-${w3}s  %s\n" CHECK EXPECTED OBSERVED RESULT
for i in "${!names[@]}"; do
    printf "%-${w1}s  %-${w2}s  %-${w3}s  %s\n" "${names[$i]}" "${expects[$i]}" "${observeds[$i]}" "${verdicts[$i]}"
    [[ ${verdicts[$i]} == PASS ]] || failed=$((failed + 1))
done
echo
if ((failed)); then
    echo "gpu-check: $failed of ${#names[@]} checks FAILED; logs and ledgers in $work"
    exit 1
fi
echo "gpu-check: all ${#names[@]} checks passed"
if ((keep)); then
    echo "gpu-check: logs and ledgers in $work"
else
    rm -rf "$work"
fi
