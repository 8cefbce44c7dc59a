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
#include <stddef.h>
#include <stdint.h>
#include <unistd.h>

#define FOXHUNT_LAND_ABI 1

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
