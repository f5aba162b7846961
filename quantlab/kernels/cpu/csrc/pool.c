#include "quantlab_cpu.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <time.h>

/* ---- threads ----------------------------------------------------------------------------------
 * Two ways to run a job on several threads, and a third to hold one team through many jobs
 * (`ql_run_team`, below: the decode step's products and attention).
 *
 * `ql_run`, for every call when torch runs on OpenMP (libgomp): `ql_use_openmp` hands over
 * libgomp's GOMP_parallel and the job runs on torch's own OpenMP team. Around our calls torch
 * runs ops of its own (norms, attention, the compiled step's kernels) on that team, whose
 * threads spin between ops; a second pool of ours would fight them for the same cores: on a quiet
 * machine both bulk work and decoding run faster on torch's team (benchmarks/RESULTS.md).
 *
 * `ql_run_own`, when torch's team is unknown, after a fork (libgomp's threads do not survive
 * one), or with QUANTLAB_THREAD_POOL=own: a pool of our own. A job is cut into chunks that
 * threads claim from one atomic ticket (generation << 32 | next chunk). The calling thread
 * works too and afterwards waits only for chunks a worker has claimed, never for a worker to
 * wake up: on a loaded machine a late worker finds nothing left, and the call runs at one
 * thread's speed instead of stalling for a scheduler time slice, as an OpenMP join does (beside a
 * busy process this pool is several times faster at one row, and never stalls; benchmarks/RESULTS.md):
 * the choice for a machine shared with other busy processes. Idle
 * workers spin for a short while, so the next layer's call finds them awake, then sleep on a
 * condition variable.
 *
 * `ql_run` also leaves torch's team by itself while the machine is busy: when the callers of
 * QL_STALLS_TO_LEAVE calls in a row waited longer than they worked, by `ql_stall_ns` or more (a
 * team thread was not running, so the join waited for a scheduler time slice; an uneven split
 * waits less than the caller works), the next calls take our pool for `ql_own_ns`, then try the
 * team again. Beside another process running torch on both cores, a call then costs little more
 * than fp32's instead of a scheduler time slice (benchmarks/RESULTS.md). A single stall is common on
 * a lightly loaded machine and would send many of an eager decode's calls to our pool, costing
 * tokens/s, hence several stalls in a row.
 */

#define QL_MAX_WORKERS 63

/* One job at a time, its chunks claimed from one atomic ticket (generation << 32 | next chunk). */
typedef struct {
    _Atomic uint64_t ticket;
    _Atomic int64_t done;
    _Atomic int64_t chunks;
    _Atomic(ql_task) task;
    _Atomic(void *) arg;
} ql_queue;

static struct {
    pthread_mutex_t lock;     /* guards sleeping and starting workers */
    pthread_cond_t wake;
    pthread_mutex_t running;  /* one job at a time; a second caller works alone */
    ql_queue queue;
    _Atomic int helpers;      /* workers allowed to join the current job */
    _Atomic int sleepers;
    int workers;
} ql_pool = {.lock = PTHREAD_MUTEX_INITIALIZER, .wake = PTHREAD_COND_INITIALIZER, .running = PTHREAD_MUTEX_INITIALIZER};

static int64_t ql_spin_ns = 50000;

static int64_t ql_now_ns(void) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (int64_t)now.tv_sec * 1000000000 + now.tv_nsec;
}

static inline void ql_pause(void) {
#ifdef QL_X86
    __builtin_ia32_pause();
#endif
}

static inline uint64_t ql_generation(ql_queue *queue) { return atomic_load(&queue->ticket) >> 32; }

/* Claim the next chunk of job `generation`; 0 once the job has none left (or has ended). */
static int ql_claim(ql_queue *queue, uint64_t generation, int64_t *chunk) {
    uint64_t ticket = atomic_load(&queue->ticket);
    for (;;) {
        if (ticket >> 32 != generation) return 0;
        int64_t next = (int64_t)(ticket & 0xffffffffu);
        if (next >= atomic_load(&queue->chunks)) return 0;
        if (atomic_compare_exchange_weak(&queue->ticket, &ticket, ticket + 1)) {
            *chunk = next;
            return 1;
        }
    }
}

/* A successful claim proves the job is unfinished, so task and arg read before it are its own. */
static void ql_work(ql_queue *queue, uint64_t generation) {
    ql_task task = atomic_load(&queue->task);
    void *arg = atomic_load(&queue->arg);
    int64_t chunk;
    while (ql_claim(queue, generation, &chunk)) {
        task(arg, chunk);
        atomic_fetch_add(&queue->done, 1);
    }
}

/* Post a job on `queue` (its generation after the current one) and return that generation. */
static uint64_t ql_post(ql_queue *queue, ql_task task, void *arg, int64_t chunks) {
    atomic_store(&queue->task, task);
    atomic_store(&queue->arg, arg);
    atomic_store(&queue->chunks, chunks);
    atomic_store(&queue->done, 0);
    uint64_t generation = ql_generation(queue) + 1;
    atomic_store(&queue->ticket, generation << 32);
    return generation;
}

/* The poster works on its own job too, then waits only for the chunks others claimed: a late
 * helper finds nothing left, and a helper preempted inside its chunk gets the core back. */
static void ql_work_and_wait(ql_queue *queue, uint64_t generation, int64_t chunks) {
    ql_work(queue, generation);
    for (int spins = 0; atomic_load(&queue->done) < chunks; spins++) {
        if (spins < 4096)
            ql_pause();
        else
            sched_yield();
    }
}

/* A team held through ql_run_team (below); the calling thread's, while it runs the body. */
typedef struct {
    ql_queue queue;
    _Atomic int ended;
    pthread_t driver;
    void (*body)(void *);
    void *arg;
} ql_team;

static _Thread_local ql_team *ql_current_team = NULL;

static void *ql_worker(void *index_pointer) {
    int index = (int)(intptr_t)index_pointer;
    uint64_t seen = 0;
    for (;;) {
        uint64_t generation = ql_generation(&ql_pool.queue);
        if (generation != seen) {
            seen = generation;
            if (index < atomic_load(&ql_pool.helpers)) ql_work(&ql_pool.queue, generation);
            continue;
        }
        int64_t deadline = ql_now_ns() + ql_spin_ns;
        for (int spins = 0; ql_generation(&ql_pool.queue) == seen; spins++) {
            ql_pause();
            if ((spins & 63) == 0 && ql_now_ns() > deadline) break;
        }
        if (ql_generation(&ql_pool.queue) != seen) continue;
        pthread_mutex_lock(&ql_pool.lock);
        atomic_fetch_add(&ql_pool.sleepers, 1);
        while (ql_generation(&ql_pool.queue) == seen) pthread_cond_wait(&ql_pool.wake, &ql_pool.lock);
        atomic_fetch_sub(&ql_pool.sleepers, 1);
        pthread_mutex_unlock(&ql_pool.lock);
    }
    return NULL;
}

/* ---- torch's OpenMP team (ql_run) ---- */

typedef void (*ql_gomp_parallel_fn)(void (*function)(void *), void *data, unsigned threads, unsigned flags);
static ql_gomp_parallel_fn ql_gomp_parallel = NULL;

typedef struct {
    ql_task task;
    void *arg;
    int64_t chunks;
    _Atomic int64_t next;
    pthread_t caller;
    int64_t caller_busy_ns; /* how long the calling thread worked */
} ql_team_job;

static int64_t ql_stall_ns = 1000000;   /* a wait this much longer than the work: a thread was absent */
static int64_t ql_own_ns = 1000000000;  /* then our pool for this long */
static _Atomic int64_t ql_team_after_ns = 0;
static _Atomic int ql_stalls_in_row = 0;
#define QL_STALLS_TO_LEAVE 3            /* one stall now and then is noise; several in a row, a busy machine */
static _Atomic int64_t ql_calls[2];     /* calls of more than one thread: [0] our pool, [1] torch's team */

static void ql_team_work(void *data) {
    ql_team_job *job = (ql_team_job *)data;
    int64_t begin = ql_now_ns();
    for (int64_t chunk; (chunk = atomic_fetch_add(&job->next, 1)) < job->chunks;) job->task(job->arg, chunk);
    if (pthread_equal(pthread_self(), job->caller)) job->caller_busy_ns = ql_now_ns() - begin;
}

/* Tests set the stall bound (very negative: every call stalls) and read how many calls each way took. */
QL_API void ql_set_team_stall_ns(int64_t stall_ns, int64_t own_ns) {
    ql_stall_ns = stall_ns;
    ql_own_ns = own_ns;
    atomic_store(&ql_team_after_ns, 0);
    atomic_store(&ql_stalls_in_row, 0);
}

QL_API int64_t ql_pool_calls(int team) { return atomic_load(&ql_calls[team ? 1 : 0]); }

static void ql_forget_openmp_in_child(void) { ql_gomp_parallel = NULL; }

/* `gomp_parallel`: the address of GOMP_parallel in the libgomp torch loaded; NULL goes back to the pool. */
QL_API void ql_use_openmp(void *gomp_parallel) {
    static int registered = 0;
    if (!registered) {
        pthread_atfork(NULL, NULL, ql_forget_openmp_in_child);
        registered = 1;
    }
    ql_gomp_parallel = (ql_gomp_parallel_fn)gomp_parallel;
}

QL_API int ql_uses_openmp(void) { return ql_gomp_parallel != NULL; }

/* ---- the pool of our own (ql_run_own) ---- */

static void ql_after_fork_in_child(void) {
    /* The workers do not exist in a forked child: start over (they are restarted on demand). */
    pthread_mutex_init(&ql_pool.lock, NULL);
    pthread_cond_init(&ql_pool.wake, NULL);
    pthread_mutex_init(&ql_pool.running, NULL);
    atomic_store(&ql_pool.sleepers, 0);
    ql_pool.workers = 0;
}

static void ql_start_workers(int wanted) {
    static int registered = 0;
    if (wanted > QL_MAX_WORKERS) wanted = QL_MAX_WORKERS;
    if (ql_pool.workers >= wanted) return;
    pthread_mutex_lock(&ql_pool.lock);
    if (!registered) {
        pthread_atfork(NULL, NULL, ql_after_fork_in_child);
        const char *spin = getenv("QUANTLAB_SPIN_US");
        if (spin) ql_spin_ns = (int64_t)atol(spin) * 1000;
        registered = 1;
    }
    while (ql_pool.workers < wanted) {
        pthread_t thread;
        pthread_attr_t attributes;
        pthread_attr_init(&attributes);
        pthread_attr_setdetachstate(&attributes, PTHREAD_CREATE_DETACHED);
        int failed = pthread_create(&thread, &attributes, ql_worker, (void *)(intptr_t)ql_pool.workers);
        pthread_attr_destroy(&attributes);
        if (failed) break;
        ql_pool.workers++;
    }
    pthread_mutex_unlock(&ql_pool.lock);
}

/* Run task(arg, c) for c in [0, chunks) on up to `threads` threads, the caller included. */
void ql_run(ql_task task, void *arg, int64_t chunks, int threads) {
    ql_team *team = ql_current_team;
    if (team && threads > 1 && chunks > 1) {
        ql_work_and_wait(&team->queue, ql_post(&team->queue, task, arg, chunks), chunks);
        return;
    }
    if (threads > 1 && chunks > 1 && ql_gomp_parallel) {
        int64_t start = ql_now_ns();
        if (start >= atomic_load(&ql_team_after_ns)) {
            ql_team_job job = {.task = task, .arg = arg, .chunks = chunks, .caller = pthread_self()};
            atomic_init(&job.next, 0);
            ql_gomp_parallel(ql_team_work, &job, (unsigned)threads, 0);
            atomic_fetch_add(&ql_calls[1], 1);
            int64_t end = ql_now_ns(), waited = end - start - job.caller_busy_ns; /* the caller not working */
            if (waited - job.caller_busy_ns < ql_stall_ns)
                atomic_store(&ql_stalls_in_row, 0);
            else if (atomic_fetch_add(&ql_stalls_in_row, 1) + 1 >= QL_STALLS_TO_LEAVE) /* still busy after */
                atomic_store(&ql_team_after_ns, end + ql_own_ns); /* a pause, one stalled call leaves again */
            return;
        }
    }
    ql_run_own(task, arg, chunks, threads);
}

void ql_run_own(ql_task task, void *arg, int64_t chunks, int threads) {
    if (threads <= 1 || chunks <= 1 || pthread_mutex_trylock(&ql_pool.running)) {
        for (int64_t c = 0; c < chunks; c++) task(arg, c);
        return;
    }
    ql_start_workers(threads - 1);
    atomic_fetch_add(&ql_calls[0], 1);
    atomic_store(&ql_pool.helpers, threads - 1);
    uint64_t generation = ql_post(&ql_pool.queue, task, arg, chunks);
    if (atomic_load(&ql_pool.sleepers) > 0) {
        pthread_mutex_lock(&ql_pool.lock);
        pthread_cond_broadcast(&ql_pool.wake);
        pthread_mutex_unlock(&ql_pool.lock);
    }
    ql_work_and_wait(&ql_pool.queue, generation, chunks);
    pthread_mutex_unlock(&ql_pool.running);
}

/* ---- one team held through a long call (ql_run_team) ----
 * A decoding step makes four product calls a block and an attention, each a fork and join of torch's
 * team of its own; holding one team through the step saved 1-3 % of its time (benchmarks/RESULTS.md:
 * the step is bound by memory, not by these joins). ql_run_team runs body(arg) on the calling thread inside one call of
 * torch's team, whose other threads meanwhile spin on a queue of the team's own: every ql_run the
 * body makes is posted there and costs an atomic store, and the poster works on it too and waits
 * only for chunks others claimed (ql_work_and_wait), so a helper that is late or absent slows the
 * body but never stops it. Without torch's team (our own pool, a forked child, a busy machine that
 * made ql_run leave it), the body runs directly and each of its calls takes ql_run's usual way. */
static void ql_team_member(void *data) {
    ql_team *team = (ql_team *)data;
    if (pthread_equal(pthread_self(), team->driver)) {
        ql_current_team = team;
        team->body(team->arg);
        ql_current_team = NULL;
        atomic_store(&team->ended, 1);
        return;
    }
    for (uint64_t seen = 0; !atomic_load(&team->ended);) {
        uint64_t generation = ql_generation(&team->queue);
        if (generation == seen) {
            ql_pause();
            continue;
        }
        seen = generation;
        ql_work(&team->queue, generation);
    }
}

static int ql_teams_on = 1;

/* Tests compare the step on a held team with the step without one (each product its own call). */
QL_API void ql_set_teams(int on) { ql_teams_on = on; }

void ql_run_team(void (*body)(void *), void *arg, int threads) {
    if (!ql_teams_on || threads <= 1 || !ql_gomp_parallel || ql_current_team ||
        ql_now_ns() < atomic_load(&ql_team_after_ns)) {
        body(arg);
        return;
    }
    ql_team team = {.driver = pthread_self(), .body = body, .arg = arg};
    atomic_init(&team.queue.ticket, 0);
    atomic_init(&team.queue.done, 0);
    atomic_init(&team.queue.chunks, 0);
    atomic_init(&team.queue.task, NULL);
    atomic_init(&team.queue.arg, NULL);
    atomic_init(&team.ended, 0);
    ql_gomp_parallel(ql_team_member, &team, (unsigned)threads, 0);
    atomic_fetch_add(&ql_calls[1], 1);
}

int ql_in_team(void) { return ql_current_team != NULL; }

/* Chunks of whole blocks of 4 features, `per_thread` per thread: about 4 balance threads over
 * bulk work; a call on a few rows streams its weights from memory, and one contiguous run per
 * thread keeps each stream's prefetch going (ql_stream_chunks). */
int64_t ql_chunk_features(int64_t n, int threads, int per_thread) {
    int64_t per = (n + per_thread * threads - 1) / (per_thread * threads);
    per = (per + 3) / 4 * 4;
    return per < 4 ? 4 : per;
}

int ql_threads(int requested, int64_t work) {
    /* Below 32 KiB of codes a second thread costs more than it saves (a bound of 64 KiB left a small
     * layer one thread slower than two: benchmarks/RESULTS.md). */
    if (requested < 1 || work < (1 << 15)) return 1;
    return requested;
}
