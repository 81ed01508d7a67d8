/* escrow_journal.c: the journal writer (PROTOCOL.md section 10.6).
 *
 * While an app holds a session the holder does not read its master, so a replay would hold
 * only what was printed after custody ended. With a journal the app records what it reads
 * into a journal file the holder made for the session; when custody ends the holder copies
 * what the file holds into the session's replay, as if it had read those bytes itself. The
 * file is a header page (layout 2) and a ring. This writer checks the header before the
 * first write, finds where the next byte goes from the file's own `total`, and writes in
 * pieces of at most 8192 bytes: `writing`, the copy, then `total`, each one aligned 64-bit
 * atomic store with a full fence on either side of the copy, so that a crash at any point
 * leaves counters the holder can vouch for (a torn write is a marked gap, never torn output).
 * Where the holder reads the `reading` mark ("journal_reading"), each read of the master is
 * marked in flight; for an older holder the bytes go from the master straight into the ring,
 * inside one write, once poll says the read cannot block.
 *
 * The fds: none are kept. escrow__journal_map maps the file it is given and does not close
 * it (the caller closes it at once); the mapping is shared and writable, and with
 * MADV_DONTFORK (Linux) a forked child does not inherit it.
 */
#include "escrow_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#if defined(__STDC_VERSION__) && __STDC_VERSION__ >= 201112L && !defined(__STDC_NO_ATOMICS__)
#include <stdatomic.h>
#define STORE64(p, v) atomic_store_explicit((_Atomic uint64_t *)(void *)(p), (v), \
                                            memory_order_relaxed)
#define LOAD64(p) atomic_load_explicit((_Atomic uint64_t *)(void *)(p), memory_order_relaxed)
#define FENCE() atomic_thread_fence(memory_order_seq_cst)
#elif defined(__GNUC__)
/* C99: the compiler's builtins are the same atomic stores and fence. */
#define STORE64(p, v) __atomic_store_n((p), (v), __ATOMIC_RELAXED)
#define LOAD64(p) __atomic_load_n((p), __ATOMIC_RELAXED)
#define FENCE() __atomic_thread_fence(__ATOMIC_SEQ_CST)
#else
#error "the journal needs 64-bit atomic stores: C11 atomics, or GCC/Clang builtins"
#endif

/* ---- the header, layout 2 (PROTOCOL.md 10.6, "The header") ------------------------------ */

#define HEADER_BYTES 4096
#define LAYOUT_VERSION 2
#define MAX_PIECE 8192 /* a torn write loses at most this much */

static uint64_t *counter(const escrow__journal *j, size_t offset) {
    return (uint64_t *)(void *)(j->base + offset);
}
#define TOTAL(j) counter((j), 32)
#define WRITING(j) counter((j), 40)
#define READING(j) counter((j), 48)

static uint64_t u64_at(const unsigned char *p) {
    uint64_t v;
    memcpy(&v, p, sizeof v); /* the machine's byte order, as the file is */
    return v;
}

/* ---- mapping, and the checks before the first write ("Check it before the first write") - */

int escrow__journal_map(escrow__journal *j, int fd, const journal_info *info,
                        int mark_reading) {
    struct stat st;
    memset(j, 0, sizeof *j);
    if (fstat(fd, &st) != 0 || st.st_size < HEADER_BYTES) return -1;
    size_t size = (size_t)st.st_size;
    void *base = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (base == MAP_FAILED) return -1;
    const unsigned char *h = base;
    uint32_t version;
    memcpy(&version, h + 8, sizeof version);
    uint64_t data_offset = u64_at(h + 16), data_size = u64_at(h + 24);
    /* Another layout is another file (layout 1 was the holder's own state file): never
     * guessed at. The checksum is optional, and not checked: the bounds are what matter. */
    if (memcmp(h, "ESCROWJL", 8) != 0 || version != LAYOUT_VERSION ||
        data_offset != HEADER_BYTES || data_size == 0 || data_size > size - HEADER_BYTES) {
        munmap(base, size);
        return -1;
    }
    /* The message says how much of the data is the ring: 0 < capacity <= data size. A ring
     * longer than the room for it would write past the file's end. */
    uint64_t capacity = data_size;
    if (info != NULL) {
        if (!info->set || info->capacity <= 0 || (uint64_t)info->capacity > data_size) {
            munmap(base, size);
            return -1;
        }
        capacity = (uint64_t)info->capacity;
    }
    j->base = base;
    j->size = size;
    j->capacity = capacity; /* data[t mod capacity] */
    j->mark_reading = mark_reading;
#ifdef MADV_DONTFORK
    /* A forked child holds no custody, so it must never write here (10.6): at fork the
     * mapping stays behind. */
    j->dontfork = madvise(base, size, MADV_DONTFORK) == 0;
#endif
    return 0;
}

void escrow__journal_unmap(escrow__journal *j) {
    if (j->base != NULL) munmap(j->base, j->size);
    memset(j, 0, sizeof *j);
}

/* ---- writing ("Writing") ---------------------------------------------------------------- */

#ifdef ESCROW_TEST_HOOKS
#include <signal.h>
/* The test driver's alone (never in the library an app links): stop the process halfway
 * through the next copy, between `writing` and `total`, for a test to SIGKILL it there. */
int escrow__test_stop_in_write;

static void stop_in_write(unsigned char *ring, size_t pos, uint64_t capacity,
                          const unsigned char *data, size_t n) {
    if (!escrow__test_stop_in_write) return;
    for (size_t i = 0; i < n / 2; i++) ring[(pos + i) % capacity] = data[i];
    FENCE();
    raise(SIGSTOP);
}
#endif

/* Steps 1 to 3 for one piece of at most 8192 bytes at the byte numbered `t`. */
static void put_piece(escrow__journal *j, uint64_t t, const unsigned char *data, size_t n) {
    unsigned char *ring = j->base + HEADER_BYTES;
    size_t pos = (size_t)(t % j->capacity);
    size_t first = n < j->capacity - pos ? n : (size_t)(j->capacity - pos);
    STORE64(WRITING(j), t + n);
    FENCE(); /* no byte of the copy moves above `writing` */
#ifdef ESCROW_TEST_HOOKS
    stop_in_write(ring, pos, j->capacity, data, n);
#endif
    memcpy(ring + pos, data, first);
    if (first < n) memcpy(ring, data + first, n - first);
    FENCE(); /* nor below `total` */
    STORE64(TOTAL(j), t + n);
}

void escrow__journal_record(escrow__journal *j, const void *data, size_t len) {
    const unsigned char *p = data;
    if (j->base == NULL || len == 0) return;
    /* We are the only writer while we hold custody: the file's count is ours. */
    uint64_t t = LOAD64(TOTAL(j));
    if (len > j->capacity) {
        /* Only the last `capacity` bytes could survive: the excess is counted, not copied. */
        uint64_t skip = (uint64_t)len - j->capacity;
        STORE64(WRITING(j), t + skip);
        FENCE();
        STORE64(TOTAL(j), t + skip);
        t += skip;
        p += skip;
        len = (size_t)j->capacity;
    }
    while (len > 0) {
        size_t n = len < MAX_PIECE ? len : MAX_PIECE;
        put_piece(j, t, p, n);
        t += n;
        p += n;
        len -= n;
    }
}

/* ---- reading ("Reading") ---------------------------------------------------------------- */

/* For a holder that never looks at `reading`: the bytes go from the master straight into
 * the ring once it is readable, inside one write, so a crash is always inside a write. */
static long read_into_ring(escrow__journal *j, int master, void *buf, size_t size) {
    int flags = fcntl(master, F_GETFL);
    if (flags >= 0 && (flags & O_NONBLOCK) == 0) {
        /* The app's terminal blocks: so would this read; wait first, outside any write. */
        struct pollfd p = {master, POLLIN, 0};
        while (poll(&p, 1, -1) < 0 && errno == EINTR) {
        }
    }
    unsigned char *ring = j->base + HEADER_BYTES;
    uint64_t t = LOAD64(TOTAL(j));
    size_t pos = (size_t)(t % j->capacity);
    size_t room = size < MAX_PIECE ? size : MAX_PIECE;
    if (room > j->capacity - pos) room = (size_t)(j->capacity - pos); /* such a read never wraps */
    STORE64(WRITING(j), t + room); /* what may land over the oldest bytes, if we die */
    FENCE();
    ssize_t n = read(master, ring + pos, room);
    int e = errno;
    FENCE();
    if (n > 0) {
        STORE64(TOTAL(j), t + (uint64_t)n);
        STORE64(WRITING(j), t + (uint64_t)n);
        memcpy(buf, ring + pos, (size_t)n);
    } else {
        STORE64(WRITING(j), t);
    }
    errno = e;
    return (long)n;
}

long escrow__journal_read(escrow__journal *j, int master, void *buf, size_t size) {
    if (j->base == NULL) return (long)read(master, buf, size);
    if (!j->mark_reading) return read_into_ring(j, master, buf, size);
    /* Marked in flight: a crash between the read and the record leaves a gap marked. */
    STORE64(READING(j), LOAD64(TOTAL(j)) + 1);
    FENCE();
    ssize_t n = read(master, buf, size);
    int e = errno;
    if (n > 0) escrow__journal_record(j, buf, (size_t)n);
    FENCE();
    STORE64(READING(j), 0);
    errno = e;
    return (long)n;
}
