/* The C-speed load client of `tokenwire bench load --client c` (driven by bench/fast_client.py).
 *
 * Why C: at concurrency 64 a client's TTFT is its own work on every token in flight, so to
 * resolve 1 ms it must spend well under 1 µs per token. Python's lean client spends ~1.5,
 * Node's http2 module ~7. This one parses frames by hand and spends tens of nanoseconds.
 *
 * The least HTTP/2 that stays correct for one request shape, h2c prior knowledge:
 * - connection: preface + SETTINGS (push off, stream window 2^31-1) + a connection
 *   WINDOW_UPDATE to 2^31-1; received DATA is handed back once 2^30 of a window is used.
 *   SETTINGS and PING are ACKed; the peer's MAX_CONCURRENT_STREAMS and our send window (for
 *   request bodies) are honoured: a request that does not fit waits for another connection
 *   or a WINDOW_UPDATE.
 * - requests: the caller's template (RequestTemplate's HEADERS + DATA frames, HPACK with
 *   never-indexed literals, so valid on any stream) with each frame's stream id patched.
 * - responses: HPACK is not decoded. The status is read from the first header field, which
 *   must be an indexed static entry (0x88 = 200; 0x89..0x8e = 204..500); anything else is
 *   reported as such. A HEADERS frame after DATA is a trailer.
 * - SSE tokens: every blank-line-terminated event is stamped with the time of the read that
 *   completed it; the last TAIL bytes of the body go back to Python, which takes off the
 *   events that are not tokens ([DONE], a finish chunk with no text, a usage chunk) the way
 *   bench/wire.py does, and reads the server's stage timings from them.
 *
 * Usage: h2_client HOST PORT CONNECTIONS CONCURRENCY WARMUP REQUESTS TEMPLATE_HEX [SPREAD_US]
 * Closed loop (no SPREAD_US, or 0): every stream starts at once, in the warm-up and again in the
 * measured window. stdio: `{"warm":true}` after the warm-up, then waits for a line on stdin;
 * `{"done":{...}}` when the measured window closes, then one JSON line per measured request:
 * {"start_ns":S,"token_ns":[ns],"end_ns":N,"status":S,"error":null|"...","tail_hex":"..."},
 * times in ns from the client's start.
 * Staggered (SPREAD_US > 0): the first CONCURRENCY streams start SPREAD_US / CONCURRENCY apart
 * and each stream starts again as it ends, from warm-up into the window without a break, so
 * their offsets persist (in step, every prefill lands in one step and every slot idles while
 * a whole wave of requests is taken in). The window opens as request WARMUP is issued
 * (`{"warm":true}`, stdin is not read) and closes as the last of the REQUESTS after it ends
 * (`{"done":{..., "window_ns":[open, close]}}`); streams still open then drain, unmeasured, and
 * every request is printed, with "measured":0 or 1, so the tokens of the window are counted
 * over all streams (the measured requests alone undercount it by their own ramp).
 * A failure prints {"fatal":"why"} and exits 1.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define MAX_WINDOW 0x7fffffffu
#define REFILL_AT (1u << 30)
#define SLOTS 16384                 /* open streams per connection, at most (a power of two) */
#define TAIL 4096                   /* body bytes kept per stream for Python's closing-event parse */
#define READ_SIZE (1 << 18)
#define STALL_NS 60000000000LL
enum { DATA = 0, HEADERS = 1, RST_STREAM = 3, SETTINGS = 4, PING = 6, GOAWAY = 7, WINDOW_UPDATE = 8, CONTINUATION = 9 };
enum { END_STREAM = 0x1, ACK = 0x1, PADDED = 0x8, PRIORITY = 0x20 };

typedef struct {
    int64_t start_ns, end_ns;
    uint32_t sid;
    int64_t *token_ns; int num_tokens, cap_tokens;   /* one stamp per SSE event */
    int status, saw_data, done, prev_nl;
    char error[96];
    uint8_t tail[TAIL]; int tail_len;
} Rec;

typedef struct {
    int fd, dead, draining, got_settings, max_streams, num_open;
    int64_t send_window;            /* connection-level, for request bodies */
    uint32_t next_id, recv_used;
    int slot[SLOTS];                /* (stream id >> 1) & (SLOTS-1) -> record index, -1 when free */
    uint8_t *in; size_t in_len;     /* an incomplete frame carried to the next read */
    uint8_t *out; size_t out_len, out_cap;
} Conn;

static Conn *conns; static int num_conns;
static Rec *recs; static int num_recs;
static uint8_t *tmpl; static size_t tmpl_len; static int64_t body_len;
static int issued, completed, phase_end, concurrency;
static int64_t last_completion_ns, epoch_ns;
/* staggered mode: stream i < concurrency is due at epoch_ns + i * spread_ns / concurrency */
static int64_t spread_ns, window_open_ns, window_close_ns;
static int num_warmup, num_measured, measured_done, window_closed;
static struct timespec cpu_open, cpu_close;

static int64_t now_ns(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec * 1000000000LL + t.tv_nsec; }

static void fatal(const char *why) { printf("{\"fatal\":\"%s\"}\n", why); fflush(stdout); exit(1); }

static void put(Conn *c, const void *p, size_t n) {
    if (c->out_len + n > c->out_cap) {
        c->out_cap = (c->out_len + n) * 2;
        if (!(c->out = realloc(c->out, c->out_cap))) fatal("out of memory");
    }
    memcpy(c->out + c->out_len, p, n); c->out_len += n;
}

static void put_frame(Conn *c, int type, int flags, uint32_t sid, const void *payload, uint32_t n) {
    uint8_t h[9] = { n >> 16, n >> 8, n, type, flags, sid >> 24 & 0x7f, sid >> 16, sid >> 8, sid };
    put(c, h, 9); if (n) put(c, payload, n);
}

static void flush(Conn *c) {
    while (c->out_len && !c->dead) {
        ssize_t k = send(c->fd, c->out, c->out_len, MSG_NOSIGNAL);
        if (k < 0) { if (errno == EAGAIN || errno == EINTR) return; c->dead = 1; return; }
        memmove(c->out, c->out + k, c->out_len - k); c->out_len -= k;
    }
}

static void finish(Conn *c, uint32_t sid, const char *error) {
    int *slot = &c->slot[(sid >> 1) & (SLOTS - 1)];
    if (*slot < 0 || recs[*slot].sid != sid) return;
    Rec *r = &recs[*slot];
    *slot = -1; c->num_open--;
    r->end_ns = now_ns();
    if (error && !r->error[0]) snprintf(r->error, sizeof r->error, "%s", error);
    if (!r->error[0] && r->status != 200)
        snprintf(r->error, sizeof r->error, r->status ? "HTTP status %d" : "stream ended without a status", r->status);
    r->done = 1; completed++; last_completion_ns = r->end_ns;
    int index = r - recs;
    if (spread_ns && index >= num_warmup && index < num_warmup + num_measured && ++measured_done == num_measured) {
        window_close_ns = r->end_ns; window_closed = 1;
        clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &cpu_close);
    }
}

/* Start one stream on a connection with a free slot and window; 0 when none has both. */
static int start_stream(void) {
    for (int k = 0; k < num_conns; k++) {
        Conn *c = &conns[(issued + k) % num_conns];
        int cap = c->max_streams < SLOTS ? c->max_streams : SLOTS;
        if (c->dead || c->draining || c->num_open >= cap || c->send_window < body_len) continue;
        uint32_t sid = c->next_id; c->next_id += 2;
        if (c->slot[(sid >> 1) & (SLOTS - 1)] >= 0) continue;   /* a stream SLOTS ids old still open */
        if (spread_ns && issued == num_warmup) {    /* the staggered window opens with this request */
            window_open_ns = now_ns();
            clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &cpu_open);
            printf("{\"warm\":true}\n"); fflush(stdout);
        }
        Rec *r = &recs[issued++];
        r->sid = sid;
        c->slot[(sid >> 1) & (SLOTS - 1)] = r - recs; c->num_open++; c->send_window -= body_len;
        size_t at = c->out_len;
        put(c, tmpl, tmpl_len);
        for (size_t p = at; p + 9 <= c->out_len; p += 9 + ((size_t)c->out[p] << 16 | c->out[p + 1] << 8 | c->out[p + 2])) {
            c->out[p + 5] = sid >> 24; c->out[p + 6] = sid >> 16; c->out[p + 7] = sid >> 8; c->out[p + 8] = sid;
        }
        r->start_ns = now_ns();
        flush(c);
        return 1;
    }
    return 0;
}

/* A stream may start now: closed loop, a free place among `concurrency` within the phase;
 * staggered, also the first streams' start times, and none once the window closed. */
static int may_start(void) {
    if (issued >= phase_end || issued - completed >= concurrency) return 0;
    if (!spread_ns) return 1;
    return !window_closed && (issued >= concurrency || now_ns() >= epoch_ns + issued * spread_ns / concurrency);
}

static void top_up(void) { while (may_start() && start_stream()) {} }

/* poll's timeout: until the next staggered start is due, at most 1 s */
static int poll_ms(void) {
    if (!spread_ns || issued >= concurrency || window_closed) return 1000;
    int64_t wait = epoch_ns + issued * spread_ns / concurrency - now_ns();
    return wait <= 0 ? 0 : (int)((wait + 999999) / 1000000);
}

static void on_data(Rec *r, const uint8_t *p, size_t n, int64_t now) {
    r->saw_data = 1;
    for (size_t i = 0; i < n; i++) {
        int nl = p[i] == '\n';
        if (nl && r->prev_nl) {
            if (r->num_tokens == r->cap_tokens) {
                r->cap_tokens = r->cap_tokens ? 2 * r->cap_tokens : 64;
                if (!(r->token_ns = realloc(r->token_ns, r->cap_tokens * sizeof(int64_t)))) fatal("out of memory");
            }
            r->token_ns[r->num_tokens++] = now;
            nl = 0;                 /* non-overlapping, as bytes.count(b"\n\n") counts */
        }
        r->prev_nl = nl;
    }
    size_t keep = n < TAIL ? n : TAIL;
    if (r->tail_len + keep > TAIL) {
        size_t drop = r->tail_len + keep - TAIL;
        memmove(r->tail, r->tail + drop, r->tail_len - drop); r->tail_len -= drop;
    }
    memcpy(r->tail + r->tail_len, p + n - keep, keep); r->tail_len += keep;
}

static int status_of(const uint8_t *p, size_t n) {
    static const int statuses[] = { 200, 204, 206, 304, 400, 404, 500 };
    return n && p[0] >= 0x88 && p[0] <= 0x8e ? statuses[p[0] - 0x88] : -1;
}

static void on_frame(Conn *c, int type, int flags, uint32_t sid, const uint8_t *p, size_t n, int64_t now) {
    int idx = sid ? c->slot[(sid >> 1) & (SLOTS - 1)] : -1;
    Rec *r = idx >= 0 && recs[idx].sid == sid ? &recs[idx] : NULL;
    if (type == DATA || type == HEADERS) {
        size_t start = 0, stop = n;
        if (flags & PADDED && n) { stop -= p[0]; start = 1; }
        if (type == HEADERS && flags & PRIORITY) start += 5;
        if (type == DATA) c->recv_used += n;
        if (r && stop > start) {
            if (type == DATA) on_data(r, p + start, stop - start, now);
            else if (!r->saw_data) r->status = status_of(p + start, stop - start);
        }
        if (flags & END_STREAM) finish(c, sid, NULL);
    } else if (type == SETTINGS && !(flags & ACK)) {
        for (size_t i = 0; i + 6 <= n; i += 6)
            if ((p[i] << 8 | p[i + 1]) == 3) c->max_streams = (int)((uint32_t)p[i + 2] << 24 | p[i + 3] << 16 | p[i + 4] << 8 | p[i + 5]);
        put_frame(c, SETTINGS, ACK, 0, NULL, 0);
        c->got_settings = 1;
    } else if (type == PING && !(flags & ACK) && n == 8) {
        put_frame(c, PING, ACK, 0, p, 8);
    } else if (type == WINDOW_UPDATE && sid == 0 && n == 4) {
        c->send_window += (int64_t)((uint32_t)p[0] << 24 | p[1] << 16 | p[2] << 8 | p[3]) & MAX_WINDOW;
    } else if (type == RST_STREAM && n == 4) {
        char why[64];
        snprintf(why, sizeof why, "stream reset by the server (error code %u)", (unsigned)p[3] | p[2] << 8 | p[1] << 16);
        finish(c, sid, why);
    } else if (type == GOAWAY && n >= 8) {
        uint32_t last = ((uint32_t)p[0] << 24 | p[1] << 16 | p[2] << 8 | p[3]) & MAX_WINDOW;
        char why[64];
        snprintf(why, sizeof why, "server sent GOAWAY (error code %u)", (unsigned)p[7] | p[6] << 8 | p[5] << 16);
        c->draining = 1;            /* streams up to `last` still finish; later ones never started */
        for (int s = 0; s < SLOTS; s++)
            if (c->slot[s] >= 0 && recs[c->slot[s]].sid > last) finish(c, recs[c->slot[s]].sid, why);
    }
}

static void on_read(Conn *c, const uint8_t *data, size_t n, int64_t now) {
    if (c->in_len) {
        if (!(c->in = realloc(c->in, c->in_len + n))) fatal("out of memory");
        memcpy(c->in + c->in_len, data, n); c->in_len += n; data = c->in; n = c->in_len;
    }
    size_t pos = 0;
    while (n - pos >= 9) {
        size_t len = (size_t)data[pos] << 16 | data[pos + 1] << 8 | data[pos + 2];
        if (n - pos < 9 + len) break;
        uint32_t sid = ((uint32_t)data[pos + 5] << 24 | data[pos + 6] << 16 | data[pos + 7] << 8 | data[pos + 8]) & MAX_WINDOW;
        on_frame(c, data[pos + 3], data[pos + 4], sid, data + pos + 9, len, now);
        pos += 9 + len;
    }
    size_t rest = n - pos;
    uint8_t *carry = rest ? malloc(rest) : NULL;
    if (rest) memcpy(carry, data + pos, rest);
    free(c->in); c->in = carry; c->in_len = rest;
    if (c->recv_used >= REFILL_AT) {
        uint8_t inc[4] = { c->recv_used >> 24, c->recv_used >> 16, c->recv_used >> 8, c->recv_used };
        put_frame(c, WINDOW_UPDATE, 0, 0, inc, 4); c->recv_used = 0;
    }
}

static void fail_connection(Conn *c, const char *why) {
    c->dead = 1;
    for (int s = 0; s < SLOTS; s++)
        if (c->slot[s] >= 0) finish(c, recs[c->slot[s]].sid, why);
}

static void run_phase(int end) {
    static uint8_t buf[READ_SIZE];
    struct pollfd *fds = calloc(num_conns, sizeof *fds);
    phase_end = end; last_completion_ns = now_ns();
    top_up();
    while (spread_ns ? !(window_closed && completed == issued) : completed < end) {
        for (int i = 0; i < num_conns; i++) {
            fds[i].fd = conns[i].dead ? -1 : conns[i].fd;
            fds[i].events = POLLIN | (conns[i].out_len ? POLLOUT : 0);
        }
        if (poll(fds, num_conns, poll_ms()) < 0 && errno != EINTR) fatal("poll failed");
        for (int i = 0; i < num_conns; i++) {
            Conn *c = &conns[i];
            if (fds[i].revents & POLLOUT) flush(c);
            if (!(fds[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
            ssize_t k = recv(c->fd, buf, sizeof buf, 0);
            if (k > 0) { on_read(c, buf, k, now_ns()); flush(c); }
            else if (k == 0 || (errno != EAGAIN && errno != EINTR)) fail_connection(c, "connection closed by the server");
        }
        top_up();
        if (now_ns() - last_completion_ns > STALL_NS) fatal("no stream finished for 60 s");
    }
    free(fds);
}

/* Connect, send our preface, and read until the server's SETTINGS came. */
static void open_connection(Conn *c, const struct addrinfo *ai) {
    static const uint8_t preface[] = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
    static uint8_t buf[READ_SIZE];
    uint8_t settings[12] = { 0, 2, 0, 0, 0, 0, 0, 4, 0x7f, 0xff, 0xff, 0xff };   /* push off, window 2^31-1 */
    uint32_t inc = MAX_WINDOW - 65535;
    uint8_t refill[4] = { inc >> 24, inc >> 16, inc >> 8, inc };
    c->fd = socket(ai->ai_family, SOCK_STREAM, 0);
    if (c->fd < 0 || connect(c->fd, ai->ai_addr, ai->ai_addrlen)) fatal("cannot connect");
    int one = 1;
    setsockopt(c->fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    c->max_streams = SLOTS; c->send_window = 65535; c->next_id = 1;
    memset(c->slot, 0xff, sizeof c->slot);
    put(c, preface, sizeof preface - 1);
    put_frame(c, SETTINGS, 0, 0, settings, sizeof settings);
    put_frame(c, WINDOW_UPDATE, 0, 0, refill, 4);
    flush(c);
    while (!c->got_settings) {
        ssize_t k = recv(c->fd, buf, sizeof buf, 0);
        if (k <= 0) fatal("the server closed the connection before its SETTINGS");
        on_read(c, buf, k, now_ns());
        flush(c);
    }
}

static void connect_all(const char *host, const char *port, int num_wanted) {
    struct addrinfo hints = { .ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM }, *ai;
    if (getaddrinfo(host, port, &hints, &ai)) fatal("cannot resolve the host");
    conns = calloc(1, sizeof *conns);
    if (!conns) fatal("out of memory");
    open_connection(&conns[0], ai);
    int cap = conns[0].max_streams > 0 ? conns[0].max_streams : 1;
    num_conns = (concurrency + cap - 1) / cap > num_wanted ? (concurrency + cap - 1) / cap : num_wanted;
    if (!(conns = realloc(conns, num_conns * sizeof *conns))) fatal("out of memory");
    memset(conns + 1, 0, (num_conns - 1) * sizeof *conns);
    for (int i = 1; i < num_conns; i++) open_connection(&conns[i], ai);
    freeaddrinfo(ai);
}

static void print_rec(const Rec *r, int measured) {
    printf("{\"start_ns\":%lld,\"measured\":%d,\"token_ns\":[", (long long)(r->start_ns - epoch_ns), measured);
    for (int i = 0; i < r->num_tokens; i++) printf(i ? ",%lld" : "%lld", (long long)(r->token_ns[i] - epoch_ns));
    printf("],\"end_ns\":%lld,\"status\":%d,\"error\":", (long long)(r->end_ns - epoch_ns), r->status);
    if (r->error[0]) printf("\"%s\"", r->error); else printf("null");
    printf(",\"tail_hex\":\"");
    for (int i = 0; i < r->tail_len; i++) printf("%02x", r->tail[i]);
    printf("\"}\n");
}

static long long cpu_ns(struct timespec a, struct timespec b) {
    return (b.tv_sec - a.tv_sec) * 1000000000LL + (b.tv_nsec - a.tv_nsec);
}

/* Staggered: one phase from the first start to the window's close, then the drain. */
static void run_staggered(int warmup, int requests) {
    num_warmup = warmup; num_measured = requests;
    epoch_ns = now_ns();
    run_phase(num_recs);            /* ends early: once the window closed, when nothing is open */
    printf("{\"done\":{\"wall_ns\":%lld,\"cpu_ns\":%lld,\"num_connections\":%d,\"window_ns\":[%lld,%lld]}}\n",
           (long long)(window_close_ns - window_open_ns), cpu_ns(cpu_open, cpu_close), num_conns,
           (long long)(window_open_ns - epoch_ns), (long long)(window_close_ns - epoch_ns));
    fflush(stdout);
    for (int i = 0; i < issued; i++) print_rec(&recs[i], i >= warmup && i < warmup + requests);
    fflush(stdout);
}

int main(int argc, char **argv) {
    if (argc != 8 && argc != 9) {
        fprintf(stderr, "usage: %s HOST PORT CONNECTIONS CONCURRENCY WARMUP REQUESTS TEMPLATE_HEX [SPREAD_US]\n", argv[0]);
        return 2;
    }
    int num_wanted = atoi(argv[3]);
    concurrency = atoi(argv[4]);
    int warmup = atoi(argv[5]), requests = atoi(argv[6]);
    spread_ns = argc == 9 ? atoll(argv[8]) * 1000 : 0;
    tmpl_len = strlen(argv[7]) / 2;
    if (num_wanted < 1 || concurrency < 1 || warmup < 0 || requests < 1 || !tmpl_len || spread_ns < 0)
        fatal("bad arguments");
    tmpl = malloc(tmpl_len);
    for (size_t i = 0; i < tmpl_len; i++) sscanf(argv[7] + 2 * i, "%2hhx", &tmpl[i]);
    for (size_t p = 0; p + 9 <= tmpl_len; p += 9 + ((size_t)tmpl[p] << 16 | tmpl[p + 1] << 8 | tmpl[p + 2]))
        if (tmpl[p + 3] == DATA) body_len += (size_t)tmpl[p] << 16 | tmpl[p + 1] << 8 | tmpl[p + 2];
    num_recs = warmup + requests + (spread_ns ? concurrency : 0);     /* staggered: and the drain */
    if (!(recs = calloc(num_recs, sizeof *recs))) fatal("out of memory");
    epoch_ns = now_ns();
    connect_all(argv[1], argv[2], num_wanted);
    if (spread_ns) {
        run_staggered(warmup, requests);
        return 0;
    }
    run_phase(warmup);
    printf("{\"warm\":true}\n"); fflush(stdout);
    char line[16];
    if (!fgets(line, sizeof line, stdin)) fatal("no go line on stdin");
    struct timespec cpu0, cpu1;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &cpu0);
    int64_t start = now_ns();
    run_phase(num_recs);
    int64_t wall = now_ns() - start;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &cpu1);
    printf("{\"done\":{\"wall_ns\":%lld,\"cpu_ns\":%lld,\"num_connections\":%d}}\n", (long long)wall,
           cpu_ns(cpu0, cpu1), num_conns);
    fflush(stdout);
    for (int i = warmup; i < num_recs; i++) print_rec(&recs[i], 1);
    fflush(stdout);
    return 0;
}
