/* A stand-in for build/libaerie-cuda.so, for the plugin loader's ABI
 * check (test_device.c). The Makefile builds it three times:
 *   - FAKE_ABI=(KN_BACKEND_ABI + 1): a plugin of another backend ABI;
 *   - no FAKE_ABI: a plugin from before the ABI was versioned, with no
 *     kn_cuda_abi;
 *   - FAKE_ABI=KN_BACKEND_ABI: one that matches, whose kn_cuda_open
 *     answers with an error naming itself, so the test sees the loader
 *     got past the check and called it.
 * It links nothing of libaerie, as the real plugin does not. */
#include <stdint.h>
#include <stdio.h>

#include "../../kernels/backend.h"
#include "../../kernels/device.h"

#ifdef FAKE_ABI
__attribute__((visibility("default"))) const uint32_t kn_cuda_abi = FAKE_ABI;
#endif

__attribute__((visibility("default"))) int kn_cuda_open(int index, const kn_backend **be, kn_device_info *info,
                                                        ae_error *err);

int kn_cuda_open(int index, const kn_backend **be, kn_device_info *info, ae_error *err) {
    (void)be;
    (void)info;
    snprintf(err->msg, sizeof err->msg, "fake plugin: kn_cuda_open(%d) was called", index);
    return AE_ERR;
}
