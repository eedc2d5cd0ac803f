/* The plugin loader (kernels/device.c) and the backend ABI
 * (kernels/backend.h KN_BACKEND_ABI): a plugin of another ABI, or one
 * from before the ABI was versioned, is refused with a message naming
 * both versions and the fix, before anything of it is called; one of
 * this ABI is opened. The stand-ins are fake_cuda_plugin.c, built by the
 * Makefile beside this binary. The plugins the build made
 * (build/libaerie-cuda.so by nvcc, build/shim/libaerie-cuda.so on the CPU
 * shim) must carry this ABI. Run from the repo root. */
#include <dlfcn.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "../../kernels/backend.h"
#include "../../kernels/device.h"

#define REAL_PLUGIN "build/libaerie-cuda.so"
#define SHIM_PLUGIN "build/shim/libaerie-cuda.so"

/* fake_cuda_<kind>.so, beside this test's binary. */
static void fake_path(const char *kind, char *out, size_t n) {
    char exe[4096];
    ssize_t len = readlink("/proc/self/exe", exe, sizeof exe - 1);
    assert_true(len > 0);
    exe[len] = '\0';
    char *slash = strrchr(exe, '/');
    assert_non_null(slash);
    *slash = '\0';
    assert_true((size_t)snprintf(out, n, "%s/fake_cuda_%s.so", exe, kind) < n);
    assert_int_equal(access(out, R_OK), 0); /* the Makefile builds it with this test */
}

/* kn_device_open(spec) with the plugin at `path`. */
static int open_with(const char *path, const char *spec, kn_device *d, ae_error *err) {
    assert_int_equal(setenv("AERIE_CUDA_LIB", path, 1), 0);
    int rc = kn_device_open(spec, d, err);
    unsetenv("AERIE_CUDA_LIB");
    return rc;
}

static void test_a_plugin_of_another_abi_is_refused(void **state) {
    (void)state;
    char path[4200], want[4800];
    fake_path("next", path, sizeof path);
    kn_device d;
    ae_error err = {{0}};
    assert_int_equal(open_with(path, "cuda", &d, &err), AE_ERR);
    snprintf(want, sizeof want,
             "--device cuda: %s was built for backend ABI %u, but this libaerie is ABI %u (kernels/backend.h); "
             "rebuild the plugin with this libaerie: make cuda",
             path, KN_BACKEND_ABI + 1u, (unsigned)KN_BACKEND_ABI);
    assert_true(strlen(want) < AE_ERR_MAX); /* whole, not cut to ae_error's size */
    assert_string_equal(err.msg, want);

    /* auto falls back to the CPU and says why */
    ae_error none = {{0}};
    assert_int_equal(open_with(path, "auto", &d, &none), AE_OK);
    assert_string_equal(none.msg, "");
    assert_int_equal(d.kind, KN_DEVICE_CPU);
    assert_ptr_equal(d.be, &kn_backend_cpu);
    assert_string_equal(d.why, want + strlen("--device cuda: "));
}

static void test_a_plugin_without_a_version_is_refused(void **state) {
    (void)state;
    char path[4200], want[4800];
    fake_path("none", path, sizeof path);
    kn_device d;
    ae_error err = {{0}};
    assert_int_equal(open_with(path, "cuda:1", &d, &err), AE_ERR);
    snprintf(want, sizeof want,
             "--device cuda:1: %s has no kn_cuda_abi: it was built before the backend ABI was versioned, and this "
             "libaerie is ABI %u (kernels/backend.h); rebuild the plugin with this libaerie: make cuda",
             path, (unsigned)KN_BACKEND_ABI);
    assert_true(strlen(want) < AE_ERR_MAX); /* whole, not cut to ae_error's size */
    assert_string_equal(err.msg, want);
}

/* The check lets a plugin of this ABI through to its entry point. */
static void test_a_plugin_of_this_abi_is_opened(void **state) {
    (void)state;
    char path[4200];
    fake_path("same", path, sizeof path);
    kn_device d;
    ae_error err = {{0}};
    assert_int_equal(open_with(path, "cuda:3", &d, &err), AE_ERR);
    assert_string_equal(err.msg, "--device cuda:3: fake plugin: kn_cuda_open(3) was called");
}

/* The plugins this tree builds carry this ABI; the shim's opens as
 * cuda:0. The nvcc-built one opens only where there is a GPU, but its
 * failure elsewhere must be that, not the ABI. */
static void test_the_built_plugins_are_this_abi(void **state) {
    (void)state;
    const char *plugins[] = {REAL_PLUGIN, SHIM_PLUGIN};
    int checked = 0;
    for (size_t i = 0; i < sizeof plugins / sizeof plugins[0]; i++) {
        if (access(plugins[i], R_OK) != 0) continue;
        void *h = dlopen(plugins[i], RTLD_NOW | RTLD_LOCAL);
        if (!h) fail_msg("%s: %s", plugins[i], dlerror());
        const uint32_t *abi = (const uint32_t *)dlsym(h, KN_CUDA_ABI);
        if (!abi) fail_msg("%s has no %s", plugins[i], KN_CUDA_ABI);
        assert_int_equal(*abi, KN_BACKEND_ABI);

        kn_device d;
        ae_error err = {{0}};
        int rc = open_with(plugins[i], "cuda", &d, &err);
        if (strcmp(plugins[i], SHIM_PLUGIN) == 0 || rc == AE_OK) {
            if (rc != AE_OK) fail_msg("%s", err.msg);
            assert_int_equal(d.kind, KN_DEVICE_CUDA);
            assert_string_equal(d.be->name, "cuda");
            assert_string_equal(d.name, "cuda:0");
        } else {
            assert_null(strstr(err.msg, "ABI"));
            assert_null(strstr(err.msg, KN_CUDA_ABI));
        }
        printf("  %s: backend ABI %u, %s\n", plugins[i], (unsigned)*abi, rc == AE_OK ? "opened" : err.msg);
        checked++;
        /* h stays loaded, as the loader leaves a plugin it opened */
    }
    if (checked == 0) {
        printf("  neither %s (make cuda) nor %s (make %s) is built\n", REAL_PLUGIN, SHIM_PLUGIN, SHIM_PLUGIN);
        skip();
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_a_plugin_of_another_abi_is_refused),
        cmocka_unit_test(test_a_plugin_without_a_version_is_refused),
        cmocka_unit_test(test_a_plugin_of_this_abi_is_opened),
        cmocka_unit_test(test_the_built_plugins_are_this_abi),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
