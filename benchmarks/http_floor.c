/*
 * The floor of an HTTP service on this machine: a server that does nothing per
 * request but read it and write a fixed answer (benchmarks/http_floor.py builds and
 * runs it).  Each of its threads has a listening socket of its own on the same port
 * (SO_REUSEPORT) and an epoll loop; a request is complete at its head's end plus its
 * Content-Length; keep-alive; pipelined requests answered in order.  No parse of the
 * body, no work: what wrk measures against it is the kernel's and wrk's own share of
 * a request, which no service can go below.
 *
 *     cc -O2 -pthread -o http_floor http_floor.c && ./http_floor PORT THREADS ANSWER_BYTES
 */
#define _GNU_SOURCE
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

enum { BUF = 1 << 20, MAX_EVENTS = 64 };

static int port;
static char answer[4096];
static int answer_len;

typedef struct {
    int fd;
    size_t have;
    char buf[BUF];
} Conn;

static int listener(void) {
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0), one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    setsockopt(fd, SOL_SOCKET, SO_REUSEPORT, &one, sizeof one);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(port),
                            .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    if (bind(fd, (struct sockaddr *)&a, sizeof a) < 0 || listen(fd, 1024) < 0) {
        perror("bind/listen");
        exit(1);
    }
    return fd;
}

/* Answer every complete request in c->buf; -1 to close. */
static int answer_requests(Conn *c) {
    size_t at = 0;
    for (;;) {
        char *end = memmem(c->buf + at, c->have - at, "\r\n\r\n", 4);
        if (end == NULL) break;
        size_t head = end + 4 - (c->buf + at), body = 0;
        char *cl = memmem(c->buf + at, head, "Content-Length:", 15);
        if (cl != NULL) body = strtoul(cl + 15, NULL, 10);
        if (c->have - at < head + body) break;
        at += head + body;
        if (write(c->fd, answer, answer_len) != answer_len) return -1;
    }
    memmove(c->buf, c->buf + at, c->have - at);
    c->have -= at;
    return c->have == BUF ? -1 : 0;
}

static void *loop(void *unused) {
    (void)unused;
    int lfd = listener(), ep = epoll_create1(0);
    struct epoll_event ev = {.events = EPOLLIN, .data.ptr = NULL}, events[MAX_EVENTS];
    epoll_ctl(ep, EPOLL_CTL_ADD, lfd, &ev);
    for (;;) {
        int n = epoll_wait(ep, events, MAX_EVENTS, -1);
        for (int i = 0; i < n; i++) {
            Conn *c = events[i].data.ptr;
            if (c == NULL) {
                int fd = accept4(lfd, NULL, NULL, SOCK_NONBLOCK), one = 1;
                if (fd < 0) continue;
                setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
                c = calloc(1, sizeof *c);
                c->fd = fd;
                struct epoll_event add = {.events = EPOLLIN, .data.ptr = c};
                epoll_ctl(ep, EPOLL_CTL_ADD, fd, &add);
                continue;
            }
            ssize_t got = read(c->fd, c->buf + c->have, BUF - c->have);
            if (got > 0) c->have += got;
            if (got == 0 || (got < 0 && errno != EAGAIN) || (got > 0 && answer_requests(c) < 0)) {
                close(c->fd); /* (closing removes it from the epoll set) */
                free(c);
            }
        }
    }
    return NULL;
}

int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: %s PORT THREADS ANSWER_BYTES\n", argv[0]);
        return 2;
    }
    port = atoi(argv[1]);
    int threads = atoi(argv[2]), size = atoi(argv[3]);
    char body[2048];
    if (size < 2 || size > (int)sizeof body - 1) size = 200;
    memset(body, ' ', size);
    body[0] = '{';
    body[size - 1] = '}';
    answer_len = snprintf(answer, sizeof answer,
                          "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                          "Content-Length: %d\r\n\r\n%.*s", size, size, body);
    pthread_t t[64];
    for (int i = 0; i < threads && i < 64; i++) pthread_create(&t[i], NULL, loop, NULL);
    pthread_join(t[0], NULL);
    return 0;
}
