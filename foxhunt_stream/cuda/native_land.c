/* One contiguous chunk of a load, landed on a GPU with the GIL released once for all its steps.
 *
 * The pipeline's worker loop (engine/targets.py, CudaTarget.land_all) calls land_chunk per chunk
 * through ctypes: wait for the slot's last copy, read the chunk into the pinned slot, queue its
 * copy to the device and record the slot's event. In Python those are four calls, each releasing
 * and re-taking the GIL that sixteen workers share; here it is one. The CUDA calls are the
 * driver's (cuMemcpyHtoDAsync, cuEventRecord, cuEventSynchronize), handed in as function pointers
 * by cuda/native.py, so this file needs no CUDA headers and links nothing but libc.
 *
 * Plain C: built at install time where a compiler is (optional), loaded with ctypes.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <sched.h>
#include <stddef.h>
#include <stdint.h>
#include <time.h>
#include <unistd.h>

#define FOXHUNT_LAND_ABI 2

typedef int (*htod_fn)(uint64_t dst, const void *src, size_t nbytes, void *stream);
typedef int (*record_fn)(void *event, void *stream);
typedef int (*sync_fn)(void *event);

typedef struct {
    htod_fn htod;      /* cuMemcpyHtoDAsync_v2 */
    record_fn record;  /* cuEventRecord */
    sync_fn sync;      /* cuEventSynchronize */
} driver_t;

/* what land_chunk returns when a CUDA call fails (the chunk's bytes read is returned otherwise) */
enum { LAND_SYNC_FAILED = -1, LAND_COPY_FAILED = -2, LAND_RECORD_FAILED = -3 };

static int64_t landed_chunks;   /* chunks landed here since the process started (tests, diagnostics) */

int foxhunt_land_abi(void) { return FOXHUNT_LAND_ABI; }

int64_t foxhunt_landed_chunks(void) { return __atomic_load_n(&landed_chunks, __ATOMIC_RELAXED); }

/* Land nbytes at file offset src of fd in device memory at dst, through slot (pinned, at least
 * nbytes) and its event, on stream. wait: the slot's event stands for a copy still in flight.
 *
 * Returns nbytes when the copy is queued and the event recorded; a count below nbytes when the
 * read came up short or failed (nothing queued: the caller finishes the read and says why); or a
 * LAND_* code when a CUDA call failed (the caller repeats that step, which reports the error). */
int64_t foxhunt_land_chunk(const driver_t *drv, int fd, int64_t src, int64_t nbytes, char *slot, void *event,
                           int wait, uint64_t dst, void *stream)
{
    if (wait && drv->sync(event) != 0)
        return LAND_SYNC_FAILED;
    int64_t got = 0;
    while (got < nbytes) {
        ssize_t r = pread(fd, slot + got, (size_t)(nbytes - got), (off_t)(src + got));
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            return got;
        got += r;
    }
    if (drv->htod(dst, slot, (size_t)nbytes, stream) != 0)
        return LAND_COPY_FAILED;
    if (drv->record(event, stream) != 0)
        return LAND_RECORD_FAILED;
    __atomic_add_fetch(&landed_chunks, 1, __ATOMIC_RELAXED);
    return nbytes;
}

/* A queue of contiguous chunks that the load's caller fills while the workers land them: the
 * caller parses, plans and allocates file by file, appends the chunks it has a destination for
 * and publishes them; each worker loops in land_queue with the GIL released throughout, so the
 * caller's Python runs beside the copies instead of before them. */
typedef struct {
    int64_t fd;
    int64_t src;
    int64_t nbytes;
    uint64_t dst;
} record_t;

typedef struct {
    record_t *records;   /* capacity records, filled in order by the caller */
    int64_t capacity;
    int64_t published;   /* records [0, published) may be claimed */
    int64_t next;        /* the next record to claim */
    int32_t sealed;      /* nothing comes after published */
    int32_t stop;        /* claim nothing more (a failure, a cancel) */
} queue_t;

void foxhunt_queue_publish(queue_t *q, int64_t n) { __atomic_store_n(&q->published, n, __ATOMIC_RELEASE); }

void foxhunt_queue_seal(queue_t *q) { __atomic_store_n(&q->sealed, 1, __ATOMIC_RELEASE); }

void foxhunt_queue_stop(queue_t *q) { __atomic_store_n(&q->stop, 1, __ATOMIC_RELEASE); }

/* Wait until record i is published (1), or no record will ever be there or the queue is stopped (0). */
static int wait_published(queue_t *q, int64_t i)
{
    for (unsigned spins = 0;; spins++) {
        if (i < __atomic_load_n(&q->published, __ATOMIC_ACQUIRE))
            return 1;
        if (__atomic_load_n(&q->stop, __ATOMIC_ACQUIRE))
            return 0;
        if (__atomic_load_n(&q->sealed, __ATOMIC_ACQUIRE))
            return i < __atomic_load_n(&q->published, __ATOMIC_ACQUIRE);
        if (spins < 64) {
            sched_yield();
        } else {
            struct timespec pause = {0, 20000};   /* 20 us: the caller is planning the next file */
            nanosleep(&pause, NULL);
        }
    }
}

/* Land the queue's records through this worker's ring of n_slots pinned slots and their events on
 * stream, from slot *slot on (pending[k]: slot k's event stands for a copy in flight), until the
 * queue is sealed and drained or stopped. Returns the records landed. *failed is -1 then, or the
 * index of a record land_chunk could not finish, with its result in *code (the caller finishes or
 * reports it in Python, then calls again); *slot is the slot that record was read into. */
int64_t foxhunt_land_queue(const driver_t *drv, queue_t *q, char *const *slots, void *const *events,
                           int32_t *pending, int32_t n_slots, int32_t *slot, void *stream, int64_t *failed,
                           int64_t *code)
{
    int64_t landed = 0;
    int32_t k = *slot;
    *failed = -1;
    for (;;) {
        if (__atomic_load_n(&q->stop, __ATOMIC_ACQUIRE))
            break;
        int64_t i = __atomic_fetch_add(&q->next, 1, __ATOMIC_ACQ_REL);
        if (i >= q->capacity || !wait_published(q, i))
            break;
        const record_t *r = &q->records[i];
        int64_t got = foxhunt_land_chunk(drv, (int)r->fd, r->src, r->nbytes, slots[k], events[k], pending[k], r->dst,
                                         stream);
        if (got != r->nbytes) {
            *failed = i;
            *code = got;
            break;
        }
        pending[k] = 1;
        k = (k + 1) % n_slots;
        landed++;
    }
    *slot = k;
    return landed;
}
