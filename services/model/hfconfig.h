/* Hugging Face config.json for llama-family models and EAGLE-3 heads.
 *
 * hfconfig is plain data on purpose: parse once, then read fields. Parsing
 * checks each key's JSON type and range and the relations between them
 * (heads divide hidden, kv heads divide heads, token ids < vocab, ...);
 * errors name the key: "config.json: num_key_value_heads: 5 does not divide
 * num_attention_heads 9". JSON null counts as absent. Keys not listed here
 * are ignored. */
#ifndef AERIE_MODEL_HFCONFIG_H
#define AERIE_MODEL_HFCONFIG_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "../../kernels/kernels.h"
#include "../core/err.h"

#define HFCONFIG_MAX_EOS 8        /* eos_token_id entries kept */
#define HFCONFIG_MAX_AUX_LAYERS 8 /* eagle_aux_hidden_state_layer_ids */
#define HFCONFIG_MAX_TEXT 128     /* bytes of a string field, NUL included */
#define HFCONFIG_MAX_FILE (4u * 1024u * 1024u)

typedef enum hfconfig_rope_kind {
    HFCONFIG_ROPE_DEFAULT = 0, /* rope_scaling absent, null or "default" */
    HFCONFIG_ROPE_LLAMA3,      /* Llama 3.1 frequency-dependent scaling */
    HFCONFIG_ROPE_YARN,        /* YaRN (DeepSeek-V3, Kimi-K2) */
} hfconfig_rope_kind;

typedef struct hfconfig {
    char architecture[HFCONFIG_MAX_TEXT]; /* architectures[0]; "" if absent */
    char model_type[HFCONFIG_MAX_TEXT];   /* "llama", "qwen2"; "" if absent */
    char torch_dtype[HFCONFIG_MAX_TEXT];  /* torch_dtype (or dtype); "" if absent */
    bool text_config;                     /* the keys below are text_config's */

    /* required */
    int32_t hidden_size;
    int32_t intermediate_size;
    int32_t num_hidden_layers;
    int32_t num_attention_heads;
    int32_t vocab_size;
    double rms_norm_eps;

    /* optional, defaults in parentheses */
    int32_t num_key_value_heads;     /* (num_attention_heads) */
    int32_t head_dim;                /* (hidden_size / num_attention_heads) */
    double rope_theta;               /* (10000) */
    const char *rope_theta_key;      /* where it was read, for errors: "rope_theta" or
                                        "rope_parameters.rope_theta" (a literal) */
    int32_t max_position_embeddings; /* (2048, as transformers' LlamaConfig) */
    bool tie_word_embeddings;        /* (false) */
    bool attention_bias;             /* q/k/v/o bias; (true iff qwen2) */

    int32_t bos_token_id;                    /* (-1 = none) */
    int32_t eos_token_ids[HFCONFIG_MAX_EOS]; /* int or list in the file */
    uint32_t n_eos;                          /* (0) */

    struct {
        const char *key; /* "rope_scaling" or "rope_parameters" (a literal);
                            NULL when absent */
        hfconfig_rope_kind kind;
        double factor;                            /* llama3 and yarn */
        double low_freq_factor;                   /* llama3 only */
        double high_freq_factor;                  /* llama3 only */
        int32_t original_max_position_embeddings; /* llama3; yarn (max_position_embeddings) */
        double beta_fast, beta_slow;              /* yarn (32, 1) */
        double mscale, mscale_all_dim;            /* yarn (0: absent) */
        double attention_factor;                  /* yarn: the cos/sin factor, as transformers derives it */
    } rope_scaling;

    /* EAGLE-3 heads */
    int32_t draft_vocab_size;                       /* (0 = not a head / same as vocab) */
    int32_t aux_layer_ids[HFCONFIG_MAX_AUX_LAYERS]; /* eagle_config.
                                        eagle_aux_hidden_state_layer_ids */
    uint32_t n_aux_layers;                          /* (0 = the engine's default choice);
                                                       also read at the top level */
    bool norm_before_residual;                      /* (false) a variant of the midlayer */
} hfconfig;

/* A config with a "text_config" object (a multimodal model such as
 * Kimi-K2.5: the language model beside a vision tower) is read from that
 * object; model_type is then the text model's.
 *
 * Parses len bytes of JSON (no NUL needed). `name` prefixes error text.
 * On failure *cfg is zeroed. */
int hfconfig_parse(hfconfig *cfg, const char *json, size_t len, const char *name, ae_error *err);

/* The RoPE of a Hugging Face checkpoint: half-split (NeoX) pairs, head_dim
 * and rope_theta, and the Llama-3 frequency scaling when rope_scaling asks
 * for it. */
kn_rope_config hfconfig_rope(const hfconfig *cfg);

/* Reads and parses a config.json file; errors are prefixed with `path`. */
int hfconfig_load(hfconfig *cfg, const char *path, ae_error *err);

#endif
