// Cache write: token t's new K and V rows [num_kv_heads, head_dim] go to flat slot
// slot_mapping[t] (block slot / block_size, offset slot % block_size); slot -1 is padding
// and is skipped. Same semantics as pagedkernels.reference.write_kv_cache.
//
// A pure copy, so it is dtype-agnostic: the launcher picks the widest unit U (16, 8, 4, 2
// or 1 bytes) that divides the row size, every byte stride and both base addresses, and
// passes strides in bytes. Any stride is allowed except along head_dim, which must be
// contiguous; caches that are views into a larger buffer work unchanged.
//
// Grid: one CTA per token. Block: any multiple of 32 (the launcher uses 128).
#include "ps_device.cuh"

namespace ps {

template <typename U>
PS_DEVICE void kv_cache_write_impl(const unsigned char* __restrict__ key,
                                   const unsigned char* __restrict__ value,
                                   unsigned char* __restrict__ key_cache,
                                   unsigned char* __restrict__ value_cache,
                                   const long long* __restrict__ slot_mapping, int num_heads,
                                   int units_per_row, long long key_tok, long long key_head,
                                   long long value_tok, long long value_head,
                                   long long kc_block, long long kc_tok, long long kc_head,
                                   long long vc_block, long long vc_tok, long long vc_head,
                                   int block_size) {
  const int t = blockIdx.x;
  const long long slot = slot_mapping[t];
  if (slot < 0) return;
  const long long blk = slot / block_size;
  const long long off = slot - blk * block_size;
  const unsigned char* k_src = key + t * key_tok;
  const unsigned char* v_src = value + t * value_tok;
  unsigned char* k_dst = key_cache + blk * kc_block + off * kc_tok;
  unsigned char* v_dst = value_cache + blk * vc_block + off * vc_tok;
  const int total = num_heads * units_per_row;
  for (int i = threadIdx.x; i < total; i += blockDim.x) {
    const int h = i / units_per_row;
    const int u = i - h * units_per_row;
    reinterpret_cast<U*>(k_dst + h * kc_head)[u] =
        reinterpret_cast<const U*>(k_src + h * key_head)[u];
    reinterpret_cast<U*>(v_dst + h * vc_head)[u] =
        reinterpret_cast<const U*>(v_src + h * value_head)[u];
  }
}

}  // namespace ps

#define PS_DEFINE_KV_CACHE_WRITE(NAME, UNIT)                                                  \
  PS_KERNEL(1024)                                                                             \
  NAME(const unsigned char* key, const unsigned char* value, unsigned char* key_cache,        \
       unsigned char* value_cache, const long long* slot_mapping, int num_heads,              \
       int units_per_row, long long key_tok, long long key_head, long long value_tok,         \
       long long value_head, long long kc_block, long long kc_tok, long long kc_head,         \
       long long vc_block, long long vc_tok, long long vc_head, int block_size) {             \
    ps::kv_cache_write_impl<UNIT>(key, value, key_cache, value_cache, slot_mapping,           \
                                  num_heads, units_per_row, key_tok, key_head, value_tok,     \
                                  value_head, kc_block, kc_tok, kc_head, vc_block, vc_tok,    \
                                  vc_head, block_size);                                       \
  }

PS_DEFINE_KV_CACHE_WRITE(kv_cache_write_u128, uint4)
PS_DEFINE_KV_CACHE_WRITE(kv_cache_write_u64, uint2)
PS_DEFINE_KV_CACHE_WRITE(kv_cache_write_u32, unsigned int)
PS_DEFINE_KV_CACHE_WRITE(kv_cache_write_u16, unsigned short)
PS_DEFINE_KV_CACHE_WRITE(kv_cache_write_u8, unsigned char)
