/* How the CUDA backend's tests open it. Linked with the shim (make
 * test-cuda-cpu) the backend's entry point is called directly; built for a
 * GPU machine (make gpu-tests, tests/gpu/run.sh) with KN_TEST_GPU, the
 * plugin is opened as the services open it. */
#ifndef AERIE_TESTS_CUDA_OPEN_H
#define AERIE_TESTS_CUDA_OPEN_H

#include <stdio.h>

#include "../../kernels/device.h"

#ifdef KN_TEST_GPU
static int kn_cuda_open(int index, const kn_backend **be, kn_device_info *info, ae_error *err) {
    char name[16];
    snprintf(name, sizeof name, "cuda:%d", index);
    kn_device d;
    if (kn_device_open(name, &d, err) != AE_OK) return AE_ERR;
    *be = d.be;
    *info = d.info;
    return AE_OK;
}
#else
int kn_cuda_open(int index, const kn_backend **be, kn_device_info *info, ae_error *err);
#endif

/* The backend of cuda:0 in *be, or -1 after printing why (a cmocka group
 * setup's failure). */
static inline int cuda_open_or_say(const kn_backend **be) {
    kn_device_info info;
    ae_error err = {{0}};
    if (kn_cuda_open(0, be, &info, &err) != AE_OK) {
        fprintf(stderr, "%s\n", err.msg);
        return -1;
    }
    return 0;
}

#endif
