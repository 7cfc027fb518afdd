/*
 * cuvisor.h: the C view of cuvisor's per-container memory ledger.
 *
 * Every CUDA process of a container, the device plugin and the cuvisor CLI share one file,
 * <state dir>/ledger, mapped MAP_SHARED. It holds, per GPU (keyed by UUID), the container's
 * limit, the bytes in use, the peak and the number of refused allocations, and per process a
 * slot with the bytes that process holds on each GPU.
 *
 * Who may map it: only the container's own processes (and tools of the same trust). The
 * container can write the file, so it can truncate it under a mapping (SIGBUS) or make it say
 * anything: a node daemon reads a bounded copy with pread(2) instead, opened with O_NOFOLLOW |
 * O_NONBLOCK beneath the allocation's directory, and treats every value as a claim.
 *
 * The layout is defined in Rust (crates/shm/src/ledger.rs); this header mirrors it, and the test
 * crates/shm/tests/c_header.rs fails if the two differ. Any change to the layout bumps
 * CUVISOR_LEDGER_VERSION. All 64-bit fields sit at 8-byte-aligned offsets and there is no
 * implicit padding: sizes and offsets are the same on every LP64 or ILP32 Linux ABI.
 *
 * Concurrency. The file is written concurrently by live processes, without locks. Fields marked
 * "atomic" below must be read (and written) with atomic operations, e.g. GCC/Clang builtins:
 *     __atomic_load_n(&entry->used, __ATOMIC_ACQUIRE)
 * Other fields are written once, before the magic number is published, and may be read plainly
 * once the magic has been loaded (with acquire) and checked. Read-only tools (monitors, metrics)
 * only ever load. Writing (charging, claiming slots, reclaiming a dead process's charges) has a
 * protocol of its own; follow crates/shm/src/ledger.rs exactly, or use the Rust crate.
 *
 * How a C monitor reads the ledger:
 *   1. open("<state dir>/" CUVISOR_LEDGER_FILE, O_RDONLY) and mmap sizeof(cuvisor_ledger) bytes,
 *      PROT_READ, MAP_SHARED. A file shorter than that, or whose magic is still 0, is being
 *      created: try again later.
 *   2. Check header.magic == CUVISOR_LEDGER_MAGIC (atomic load, acquire), then
 *      header.version == CUVISOR_LEDGER_VERSION and header.size == sizeof(cuvisor_ledger).
 *      Anything else is not a ledger this header describes: refuse it.
 *   3. Iterate devices[0 .. CUVISOR_MAX_DEVICES): only entries whose state (acquire) is
 *      CUVISOR_DEV_READY are in use; their uuid_words and limit are valid after that load.
 *      uuid_words holds the GPU's 16-byte UUID as two big-endian words: byte 0 of the UUID is
 *      the most significant byte of uuid_words[0], byte 15 the least significant of
 *      uuid_words[1] (so do not memcpy the words on a little-endian host; shift).
 *      Two claimers racing for one GPU may briefly both show READY with the same UUID: the
 *      lower index is the real entry, the other goes back to EMPTY.
 *   4. Process slots: pid 0 is a free slot, CUVISOR_PID_RECLAIMING one whose owner died and
 *      whose charges are being given back; any other pid is a process of the container (as
 *      its own pid namespace numbers it: pid_ns says which), and charged[i] & CUVISOR_BYTES_MASK
 *      is what it holds on devices[i]. The high 16 bits of charged[i] count operations in
 *      flight, those of `used` count its changes. The per-process sums can differ from `used`
 *      for an instant; `used` is authoritative.
 *   5. Liveness is not the pid (it means nothing outside the slot's pid namespace): the owner of
 *      slot i holds an open-file-description lock (F_OFD_SETLK) on byte (1 << 40) + i of the
 *      file for as long as it lives. F_OFD_GETLK with F_WRLCK over that byte (or over all
 *      CUVISOR_MAX_PROCS of them) tells, without waiting, whether it (any process) is alive.
 *   6. Shares: memory whose allocating process may be gone while another process of the
 *      container still holds it. A LIVE share's bytes are part of its device's `used`, in no
 *      process slot; it is held while any process holds a lock on its byte (see
 *      cuvisor_share_entry).
 *
 * Example (prints each GPU's UUID, limit and use; give it the state directory):
 *
 * @code
 * #include <fcntl.h>
 * #include <stdio.h>
 * #include <sys/mman.h>
 * #include <sys/stat.h>
 * #include <unistd.h>
 * #include "cuvisor.h"
 *
 * int main(int argc, char **argv) {
 *     char path[4096];
 *     struct stat st;
 *     snprintf(path, sizeof path, "%s/" CUVISOR_LEDGER_FILE, argc > 1 ? argv[1] : ".");
 *     int fd = open(path, O_RDONLY);
 *     if (fd < 0 || fstat(fd, &st) != 0 || st.st_size < (off_t)sizeof(cuvisor_ledger)) return 1;
 *     const cuvisor_ledger *l = mmap(NULL, sizeof *l, PROT_READ, MAP_SHARED, fd, 0);
 *     close(fd);
 *     if (l == MAP_FAILED) return 1;
 *     if (__atomic_load_n(&l->header.magic, __ATOMIC_ACQUIRE) != CUVISOR_LEDGER_MAGIC ||
 *         l->header.version != CUVISOR_LEDGER_VERSION || l->header.size != sizeof *l) return 1;
 *     for (int i = 0; i < CUVISOR_MAX_DEVICES; i++) {
 *         const cuvisor_device_entry *d = &l->devices[i];
 *         if (__atomic_load_n(&d->state, __ATOMIC_ACQUIRE) != CUVISOR_DEV_READY) continue;
 *         uint64_t hi = __atomic_load_n(&d->uuid_words[0], __ATOMIC_ACQUIRE);
 *         uint64_t lo = __atomic_load_n(&d->uuid_words[1], __ATOMIC_ACQUIRE);
 *         printf("GPU-%08x-%04x-%04x-%04x-%012llx limit %llu used %llu\n",
 *                (unsigned)(hi >> 32), (unsigned)(hi >> 16) & 0xffff, (unsigned)hi & 0xffff,
 *                (unsigned)(lo >> 48), (unsigned long long)lo & 0xffffffffffffULL,
 *                (unsigned long long)__atomic_load_n(&d->limit, __ATOMIC_ACQUIRE),
 *                (unsigned long long)(__atomic_load_n(&d->used, __ATOMIC_ACQUIRE) & CUVISOR_BYTES_MASK));
 *     }
 *     munmap((void *)l, sizeof *l);
 *     return 0;
 * }
 * @endcode
 */
#ifndef CUVISOR_H
#define CUVISOR_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* "CUVLEDG1" in a little-endian word. */
#define CUVISOR_LEDGER_MAGIC UINT64_C(0x314744454C565543)
#define CUVISOR_LEDGER_VERSION 4
/* The ledger's file name inside the state directory. */
#define CUVISOR_LEDGER_FILE "ledger"
#define CUVISOR_MAX_DEVICES 16
#define CUVISOR_MAX_PROCS 1024
#define CUVISOR_MAX_SHARES 4096

/* cuvisor_device_entry.state */
#define CUVISOR_DEV_EMPTY 0
#define CUVISOR_DEV_CLAIMING 1 /* uuid being written: ignore the entry */
#define CUVISOR_DEV_READY 2

/* cuvisor_proc_entry.pid of a slot whose owner died and whose charges are being given back. */
#define CUVISOR_PID_RECLAIMING UINT32_C(0xFFFFFFFF)

/* cuvisor_share_entry.state */
#define CUVISOR_SHARE_FREE 0
#define CUVISOR_SHARE_CLAIMING 1 /* being claimed: no bytes yet */
#define CUVISOR_SHARE_LIVE 2
#define CUVISOR_SHARE_RECLAIMING 3 /* nobody held it: its bytes are being given back */
/* cuvisor_share_entry.key that every import of the container matches. */
#define CUVISOR_SHARE_ANY_KEY UINT64_C(0xFFFFFFFFFFFFFFFF)

/* The bytes of cuvisor_device_entry.used and cuvisor_proc_entry.charged[i] (low 48 bits). */
#define CUVISOR_BYTES_MASK UINT64_C(0xFFFFFFFFFFFF)

typedef struct cuvisor_ledger_header {
    uint64_t magic; /* atomic; CUVISOR_LEDGER_MAGIC once initialised, stored last (release) */
    uint32_t version; /* CUVISOR_LEDGER_VERSION */
    uint32_t size; /* sizeof(cuvisor_ledger) */
    uint32_t max_devices; /* CUVISOR_MAX_DEVICES */
    uint32_t max_procs; /* CUVISOR_MAX_PROCS */
    uint64_t container_id; /* random, non-zero: names the container in GPU coordinators */
} cuvisor_ledger_header;

typedef struct cuvisor_device_entry {
    uint32_t state; /* atomic; CUVISOR_DEV_EMPTY, _CLAIMING or _READY */
    uint32_t _pad;
    uint64_t uuid_words[2]; /* atomic each; the GPU UUID as two big-endian words */
    uint64_t limit; /* atomic; bytes the container may hold on this GPU */
    uint64_t used; /* atomic; & CUVISOR_BYTES_MASK: bytes it holds now (all its processes) */
    uint64_t peak; /* atomic; highest `used` seen */
    uint64_t denied; /* atomic; allocations refused for the quota */
    uint64_t gpu_ns; /* atomic; GPU time the container's launches used (ns) */
    uint64_t throttled_ns; /* atomic; time its launching threads waited for compute tokens (ns) */
    uint64_t launches; /* atomic; kernel, cooperative and graph launches */
} cuvisor_device_entry;

typedef struct cuvisor_proc_entry {
    uint32_t pid; /* atomic; 0 = free, CUVISOR_PID_RECLAIMING = being reclaimed */
    uint32_t _pad;
    uint64_t start_time; /* atomic; /proc/PID/stat start time of the owner (informational) */
    uint64_t pid_ns; /* atomic; inode of the owner's /proc/self/ns/pid (informational) */
    uint64_t charged[CUVISOR_MAX_DEVICES]; /* atomic each; & CUVISOR_BYTES_MASK: bytes held */
} cuvisor_proc_entry;

/* Memory of the container that outlives the process that allocated it while other processes of
 * the container hold it (exported VMM allocations, IPC-exported pointers). Its holders keep an
 * open-file-description read lock on byte (1 << 40) + CUVISOR_MAX_PROCS + its index; `used`
 * counts its bytes until nobody holds one. */
typedef struct cuvisor_share_entry {
    uint32_t state; /* atomic; CUVISOR_SHARE_FREE, _CLAIMING, _LIVE or _RECLAIMING */
    uint32_t device; /* atomic; index into devices[] */
    uint64_t key; /* atomic; what importers recognise the memory by (informational) */
    uint64_t bytes; /* atomic; & CUVISOR_BYTES_MASK: bytes charged; high 16 bits as charged[] */
    uint64_t _reserved;
} cuvisor_share_entry;

/* The whole file. */
typedef struct cuvisor_ledger {
    cuvisor_ledger_header header;
    cuvisor_device_entry devices[CUVISOR_MAX_DEVICES];
    cuvisor_proc_entry procs[CUVISOR_MAX_PROCS];
    cuvisor_share_entry shares[CUVISOR_MAX_SHARES];
} cuvisor_ledger;

/*
 * The GPU coordinator (crates/shm/src/coordinator.rs): one directory per physical GPU,
 * <coord dir>/gpu-<UUID as 32 hex digits>/, holding
 * - "board" (CUVISOR_COORD_BOARD): which container holds which entry, with what policy. Under
 *   the device plugin only the plugin writes it; containers see it read-only. Read it whole
 *   with pread (little-endian, as laid out below); an entry is valid when container != 0,
 *   index is its position and check matches (see Entry::seal); all zero is a free entry.
 * - "slot-NN" (NN the entry, two digits): that entry's state, written by its own container
 *   only. Others read it with pread too, as a claim (never map a file another container can
 *   truncate).
 */
#define CUVISOR_BOARD_MAGIC UINT64_C(0x3244524F42565543) /* "CUVBORD2" */
#define CUVISOR_STATE_MAGIC UINT64_C(0x3254415453565543) /* "CUVSTAT2" */
#define CUVISOR_COORD_VERSION 2
#define CUVISOR_COORD_BOARD "board"
#define CUVISOR_MAX_SLOTS 64
#define CUVISOR_POLICY_LIMIT 1 /* param: cap in ppm of GPU time, 1 .. 1000000 */
#define CUVISOR_POLICY_SHARE 2 /* param: weight in thousandths, 1 .. CUVISOR_MAX_WEIGHT */
#define CUVISOR_MAX_WEIGHT UINT64_C(1000000000)
#define CUVISOR_STALE_NS UINT64_C(2000000000)

typedef struct cuvisor_board_header {
    uint64_t magic; /* CUVISOR_BOARD_MAGIC */
    uint32_t version; /* CUVISOR_COORD_VERSION */
    uint32_t size; /* sizeof(cuvisor_board) */
    uint32_t max_slots; /* CUVISOR_MAX_SLOTS */
    uint32_t managed; /* 1: written by the device plugin alone; 0: self-service */
    uint8_t uuid[16]; /* the GPU's UUID */
    uint64_t _reserved[3];
} cuvisor_board_header;

typedef struct cuvisor_board_entry {
    uint64_t container; /* non-zero */
    uint32_t policy; /* CUVISOR_POLICY_LIMIT or _SHARE */
    uint32_t index; /* the entry's own position */
    uint64_t param; /* see the policy */
    uint64_t check; /* a seal of the other fields */
} cuvisor_board_entry;

typedef struct cuvisor_board {
    cuvisor_board_header header;
    cuvisor_board_entry entries[CUVISOR_MAX_SLOTS];
} cuvisor_board;

typedef struct cuvisor_coord_state {
    uint64_t magic; /* atomic; CUVISOR_STATE_MAGIC once initialised */
    uint32_t version; /* CUVISOR_COORD_VERSION */
    uint32_t size; /* sizeof(cuvisor_coord_state) */
    uint32_t index; /* the board entry it belongs to */
    uint32_t _pad;
    uint64_t container; /* atomic; the entry's container */
    uint64_t grant_ppm; /* atomic; refill rate last computed, ppm of GPU time */
    int64_t tokens; /* atomic; the bucket, GPU-time ns (negative: in debt) */
    uint64_t refill_at; /* atomic; CLOCK_MONOTONIC ns */
    uint64_t last_active; /* atomic; last launch, CLOCK_MONOTONIC ns */
    uint64_t throttled_at; /* atomic; last wait for tokens, CLOCK_MONOTONIC ns */
    uint64_t consumed_ns; /* atomic; GPU time used (ns) */
    uint64_t throttled_ns; /* atomic; time waited for tokens (ns) */
    uint64_t queued_until; /* atomic; modelled end of its launched work */
    uint64_t _reserved[6];
} cuvisor_coord_state;

#ifdef __cplusplus
}
#endif

#endif /* CUVISOR_H */
