/* What an EAGLE-3 head reads of its target model: the target's shape and
 * its token embedding table, and nothing else. aerie-draft opens its
 * target this way, so that it maps one table rather than every layer of
 * a model it never runs. The tensor and key names are those every GGUF
 * and Hugging Face decoder shares, whatever its architecture. */
#ifndef AERIE_MODEL_EMBEDDING_H
#define AERIE_MODEL_EMBEDDING_H

#include <stddef.h>
#include <stdint.h>

#include "../../kernels/kernels.h"
#include "../core/err.h"
#include "weights.h"

/* The view of it a head takes, from embedding_open or from a loaded
 * target model (target/model.h). */
typedef struct embedding_view {
    int32_t hidden; /* H */
    int32_t vocab;  /* target vocabulary */
    int32_t n_layers;
    const kn_weight *embed; /* [vocab][H]; must outlive the head */
} embedding_view;

typedef struct embedding {
    int32_t n_layers;
    int32_t hidden;   /* H */
    int32_t vocab;    /* V */
    kn_weight table;  /* [V][H], as the file holds it (kn_embed reads any type) */
    size_t bytes;     /* the table's bytes */
    weights_store *w; /* owner */
} embedding;

/* path: a .gguf file or a Hugging Face model directory; the table is
 * given in be's memory (weights.h). */
int embedding_open(embedding *e, const char *path, const kn_backend *be, ae_error *err);
void embedding_close(embedding *e); /* a zeroed one is a no-op */
embedding_view embedding_of(const embedding *e);

#endif
