/* connector/fingerprint.c — what two engines must share to exchange KV pages. */
#include "connector/control.h"
#include "connector/kv_connector.h"

void pd_kv_fingerprint(const char *model_id, const char *kv_dtype, int32_t block_size, int32_t num_kv_heads,
                       int32_t head_size, int32_t num_layers, Pd__Fingerprint *fp)
{
    Pd__Fingerprint init = PD__FINGERPRINT__INIT;
    *fp = init;
    fp->model = (char *)model_id;
    fp->kv_dtype = (char *)kv_dtype;
    fp->block_size = (uint32_t)block_size;
    fp->layout = (char *)"NB2BSHD";
    fp->num_kv_heads = (uint32_t)num_kv_heads;
    fp->head_size = (uint32_t)head_size;
    fp->num_layers = (uint32_t)num_layers;
    fp->protocol_version = PD_PROTOCOL_VERSION;
}
