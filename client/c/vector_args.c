/* vector_args.c: a request from its words, for the tests against the protocol's vectors
 * (PROTOCOL.md 7; vector_args.h says the words). The test driver and the Node addon both
 * parse with this one file, so a vector checked through either is checked against the same
 * reading of its arguments, and the encoders they reach are the library's own.
 */
#include "vector_args.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int parse_bool(const char *s, int *v) {
    if (strcmp(s, "true") == 0) return *v = 1, 0;
    if (strcmp(s, "false") == 0) return *v = 0, 0;
    return -1;
}

/* A number, or "-": nil (-1). */
static int parse_dim(const char *s, int64_t *v) {
    char *end;
    if (strcmp(s, "-") == 0) return *v = -1, 0;
    errno = 0;
    long long n = strtoll(s, &end, 10);
    if (errno != 0 || end == s || *end != 0 || n < 0) return -1;
    *v = n;
    return 0;
}

/* KEY=VALUE words (split at the first '='), each pair pointing into argv. */
static int parse_pairs(int argc, char **argv, const char **keys, const char **values,
                       size_t max, size_t *count) {
    *count = 0;
    for (int i = 0; i < argc; i++) {
        char *eq = strchr(argv[i], '=');
        if (eq == NULL || *count == max) return -1;
        *eq = 0;
        keys[*count] = argv[i];
        values[(*count)++] = eq + 1;
    }
    return 0;
}

static int parse_meta(int argc, char **argv, escrow_meta *meta, size_t *count) {
    const char *keys[ESCROW_META_MAX], *values[ESCROW_META_MAX];
    if (parse_pairs(argc, argv, keys, values, ESCROW_META_MAX, count) != 0) return -1;
    for (size_t i = 0; i < *count; i++) {
        meta[i].key = keys[i];
        meta[i].value = values[i];
    }
    return 0;
}

int escrow__vector_parse_update(int argc, char **argv, escrow__vector_update *u) {
    memset(u, 0, sizeof *u);
    if (argc < 2 || parse_dim(argv[0], &u->cols) != 0 || parse_dim(argv[1], &u->rows) != 0)
        return -1;
    u->meta_given = argc > 2;
    if (argc == 3 && strcmp(argv[2], "{}") == 0) return 0;
    return parse_meta(argc - 2, argv + 2, u->meta, &u->meta_count);
}

static int encode_ack_many(mp_out *o, int argc, char **argv, escrow_error *err) {
    int keep = 0, rc = -1;
    size_t n = 0;
    const char **ids = calloc((size_t)argc, sizeof *ids);
    const char **handoff_ids = calloc((size_t)argc, sizeof *handoff_ids);
    if (ids != NULL && handoff_ids != NULL && parse_bool(argv[1], &keep) == 0 &&
        parse_pairs(argc - 2, argv + 2, ids, handoff_ids, (size_t)argc, &n) == 0)
        rc = (int)escrow__encode_ack_many(o, ids, handoff_ids, n, keep, err);
    free(ids);
    free(handoff_ids);
    return rc;
}

int escrow__vector_encode(mp_out *o, int argc, char **argv, escrow_error *err) {
    const char *type = argc > 0 ? argv[0] : "";
    int keep = 0, journal = 0, replay_file = 0;
    if (strcmp(type, "hello") == 0 && argc == 4) {
        escrow_client c;
        memset(&c, 0, sizeof c);
        snprintf(c.owner, sizeof c.owner, "%s", argv[1]);
        snprintf(c.client_name, sizeof c.client_name, "%s", argv[2]);
        c.timeout = atof(argv[3]);
        return (int)escrow__encode_hello(o, &c, err);
    }
    if (strcmp(type, "deposit") == 0 && argc >= 7) {
        escrow_meta meta[ESCROW_META_MAX];
        escrow_deposit_opts opts;
        memset(&opts, 0, sizeof opts);
        opts.label = argv[2];
        opts.child_pid = atoll(argv[3]);
        opts.cols = atoll(argv[4]);
        opts.rows = atoll(argv[5]);
        opts.meta = meta;
        if (parse_bool(argv[6], &journal) != 0 ||
            parse_meta(argc - 7, argv + 7, meta, &opts.meta_count) != 0)
            return -1;
        return (int)escrow__encode_deposit(o, argv[1], &opts, journal, err);
    }
    if (strcmp(type, "release") == 0 && argc == 2)
        return (int)escrow__encode_id(o, type, argv[1], err);
    if (strcmp(type, "retrieve") == 0 && argc == 5) {
        if (parse_bool(argv[2], &keep) != 0 || parse_bool(argv[3], &journal) != 0 ||
            parse_bool(argv[4], &replay_file) != 0)
            return -1;
        return (int)escrow__encode_retrieve(o, argv[1], keep, journal, replay_file, err);
    }
    if (strcmp(type, "retrieve_many") == 0 && argc >= 5) {
        if (parse_bool(argv[1], &keep) != 0 || parse_bool(argv[2], &journal) != 0 ||
            parse_bool(argv[3], &replay_file) != 0)
            return -1;
        return (int)escrow__encode_retrieve_many(o, (const char *const *)argv + 4,
                                                 (size_t)argc - 4, keep, journal, replay_file,
                                                 err);
    }
    if (strcmp(type, "ack") == 0 && argc == 4) {
        if (parse_bool(argv[3], &keep) != 0) return -1;
        return (int)escrow__encode_ack(o, argv[1], argv[2], keep, err);
    }
    if (strcmp(type, "ack_many") == 0 && argc >= 3) return encode_ack_many(o, argc, argv, err);
    if (strcmp(type, "update") == 0 && argc >= 4) {
        escrow__vector_update u;
        if (escrow__vector_parse_update(argc - 2, argv + 2, &u) != 0) return -1;
        return (int)escrow__encode_update(o, argv[1], u.cols, u.rows,
                                          u.meta_given ? u.meta : NULL, u.meta_count, err);
    }
    if (strcmp(type, "list") == 0 && argc == 2) {
        if (parse_bool(argv[1], &keep) != 0) return -1;
        return (int)escrow__encode_list(o, keep, err);
    }
    if (strcmp(type, "status") == 0 && argc == 1) return (int)escrow__encode_status(o, err);
    return -1;
}
