/* common/limits.h — bounds the whole system shares, spelled once. */
#ifndef PD_COMMON_LIMITS_H
#define PD_COMMON_LIMITS_H

/* Decoder layers of a model: the per-layer arrays of the model config, the KV cache spec and the
 * connector's step metadata. A model with more is refused at load. */
#define PD_MAX_LAYERS 256

#endif
