/* custody_record.c: what the app read itself, recorded in the session's journal
 * (PROTOCOL.md 10.6).
 *
 * An app whose PTY library reads the master (node-pty's libuv stream, tty.ReadStream) cannot
 * have the custody read it too (libuv polls an fd once: startReading fails EEXIST), so it
 * hands each chunk it read to record(id, bytes), escrow_custody_record under it. That call
 * touches the custody, which the C client lets one thread at a time use, and a custody call
 * may be running on the pool: then the chunk is copied into a queue, and the queue is
 * flushed, in order, on the main thread as soon as that call is done, before its promise
 * settles and before any event it brings. A chunk is never dropped and never reordered: a
 * record made while chunks wait joins the queue behind them. One whose session left the
 * custody during the call (a release, a retrieve elsewhere) has no journal to go to.
 *
 * A crash between the library's read and the record loses that read unmarked; reading
 * through the custody (startReading, custody_reads.c) marks a read in flight and does not.
 */
#define _GNU_SOURCE
#include "custody.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct escrow__node_chunk {
    struct escrow__node_chunk *next;
    char id[ESCROW_NAME_MAX + 1];
    size_t len;
    unsigned char data[]; /* C99's flexible array member */
};

void escrow__node_records_flush(escrow__node_custody *c) {
    while (!c->busy && c->records != NULL) {
        escrow__node_chunk *k = c->records;
        c->records = k->next;
        if (c->records == NULL) c->records_tail = NULL;
        (void)escrow_custody_record(&c->cu, k->id, k->data, k->len); /* ENOENT: it left */
        free(k);
    }
}

int escrow__node_record(escrow__node_custody *c, const char *id, const void *data, size_t len) {
    if (!c->busy && c->records == NULL) {
        (void)escrow_custody_record(&c->cu, id, data, len); /* held: checked by the caller */
        return 0;
    }
    escrow__node_chunk *k = malloc(sizeof *k + len);
    if (k == NULL) return -1;
    k->next = NULL;
    snprintf(k->id, sizeof k->id, "%s", id);
    k->len = len;
    if (len > 0) memcpy(k->data, data, len);
    if (c->records_tail != NULL) c->records_tail->next = k;
    else c->records = k;
    c->records_tail = k;
    escrow__node_records_flush(c); /* idle with chunks waiting: they go first */
    return 0;
}

void escrow__node_records_free(escrow__node_custody *c) {
    while (c->records != NULL) {
        escrow__node_chunk *k = c->records;
        c->records = k->next;
        free(k);
    }
    c->records_tail = NULL;
}
