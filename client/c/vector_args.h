/* vector_args.h: the arguments of a request, as words, for the tests against the protocol's
 * vectors (protocol-vectors/, PROTOCOL.md 7). Not part of the library: built into the test
 * driver (escrow-c.c, its `encode` and `update` commands) and into the Node addon's codec
 * entry (client/node/src/codec.c), so that both turn the same words into the same frame.
 *
 * The words: TYPE then its arguments, BOOL `true` or `false`, a dimension a number or `-`
 * (nil), a map KEY=VALUE words (split at the first '=', in place), `{}` an empty one:
 *   hello OWNER CLIENT TIMEOUT            deposit ID LABEL CHILD COLS ROWS JOURNAL [K=V]...
 *   release ID                            retrieve ID KEEP JOURNAL REPLAY_FILE
 *   retrieve_many KEEP JOURNAL REPLAY_FILE ID...
 *   ack ID HANDOFF KEEP                   ack_many KEEP ID=HANDOFF...
 *   update ID COLS ROWS [K=V...|{}]       list ALL_OWNERS          status
 */
#ifndef ESCROW_VECTOR_ARGS_H
#define ESCROW_VECTOR_ARGS_H

#include "escrow_internal.h"

/* update's words after the id: COLS ROWS [META...]. No META: nil; "{}": an empty map. */
typedef struct escrow__vector_update {
    int64_t cols, rows;
    escrow_meta meta[ESCROW_META_MAX];
    size_t meta_count;
    int meta_given;
} escrow__vector_update;

int escrow__vector_parse_update(int argc, char **argv, escrow__vector_update *u);

/* The request argv[0..argc) names, encoded into `o` (the caller frees o->data): -1 when the
 * words are not a request's, else the encoder's escrow_code (its error in *err). */
int escrow__vector_encode(mp_out *o, int argc, char **argv, escrow_error *err);

#endif
