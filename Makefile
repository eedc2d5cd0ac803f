# Aerie: one entry point. See README.md and ARCHITECTURE.md.
#
# Sources are found by folder, so a new module needs no edit here:
#   services/*/*.c kernels/*.c kernels/cpu/*.c target/*.c target/arch/*.c draft/*.c gateway/*.c
#                                   -> build/libaerie.a
#   cli/*.c                         -> build/aerie
#   tests/unit/test_NAME.c          -> build/asan/tests/test_NAME (cmocka, ASan+UBSan)
#   tests/fuzz/fuzz_NAME.c          -> build/fuzz/fuzz_NAME (libFuzzer, ASan+UBSan)
#   tests/model/test_NAME.c         -> build/tests/test_NAME (cmocka, release build:
#                                      whole-model runs that are too slow under ASan)
#   kernels/cuda/*.cu               -> build/libaerie-cuda.so (nvcc; the CUDA plugin), and
#                                      compiled by g++ on the CPU shim for tests/cuda_cpu/

CC      ?= gcc
FUZZCC  ?= clang
PYTHON  ?= python3

WARN := -Wall -Wextra -Werror -Wshadow -Wpointer-arith -Wstrict-prototypes \
        -Wmissing-prototypes -Wvla -Wformat=2 -Wundef -Wcast-align \
        -Wno-unused-parameter
# -ffp-contract=off: the kernels promise the same bits on every SIMD path
# (kernels/kernels.h), which holds only if no compiler fuses a multiply and
# an add that the code wrote apart.
BASE_CFLAGS := -std=c11 -D_GNU_SOURCE -pthread -ffp-contract=off -MMD -MP $(WARN)
OPT     ?= -O2 -g
# The sanitizer builds (ASan+UBSan, TSan) are optimized as the release is:
# the integration tests run the services built with ASan, and at -O1 they
# decoded at half the speed of -O2, which CI's time could not afford.
SAN_OPT := -O2 -g
# Structured output runs on XGrammar's C++ library, built from its PyPI
# source release by tools/build_xgrammar.sh (target/grammar.h); it and the
# C++ runtime come after libaerie.a on every link line.
XGR_LIB := build/xgrammar/lib/libxgrammar.a
CXX     ?= g++
FUZZCXX ?= clang++
CXXFLAGS_BASE := -std=c++17 -D_GNU_SOURCE -pthread -MMD -MP -Wall -Wextra -Werror -Wno-unused-parameter \
                 -Ibuild/xgrammar/include
LIBS    := $(XGR_LIB) -lstdc++ -lcjson -levent_core -levent_pthreads -levent_openssl -lssl -lcrypto -lprotobuf-nanopb -lm -lpthread -ldl

# The wire contract (proto/aerie.proto, bounded by proto/aerie.options) is
# compiled by nanopb's generator into build/gen/; generated code is never
# committed.
NANOPB_GEN ?= nanopb_generator.py
GEN_C := build/gen/aerie.pb.c
GEN_H := build/gen/aerie.pb.h
BASE_CFLAGS += -Ibuild/gen

# target/, draft/ and gateway/ are libraries first: their main.c files
# become the service binaries, everything else goes into the library.
LIB_SRC  := $(sort $(wildcard services/*/*.c kernels/*.c kernels/cpu/*.c) \
              $(filter-out %/main.c,$(wildcard target/*.c target/arch/*.c draft/*.c gateway/*.c))) $(GEN_C)
CLI_SRC  := $(sort $(wildcard cli/*.c))
UNIT_SRC := $(sort $(wildcard tests/unit/test_*.c))
FUZZ_SRC := $(sort $(wildcard tests/fuzz/fuzz_*.c))
MODEL_SRC := $(sort $(wildcard tests/model/test_*.c))

# C++ sources of the library: the C face of XGrammar.
LIB_CXX  := target/grammar.cc
LIB_OBJ  := $(LIB_SRC:%.c=build/obj/%.o) $(LIB_CXX:%.cc=build/obj/%.o)
CLI_OBJ  := $(CLI_SRC:%.c=build/obj/%.o)
ALIB_OBJ := $(LIB_SRC:%.c=build/asan/obj/%.o) $(LIB_CXX:%.cc=build/asan/obj/%.o)
ACLI_OBJ := $(CLI_SRC:%.c=build/asan/obj/%.o)
UNIT_BIN := $(UNIT_SRC:tests/unit/%.c=build/asan/tests/%)
TLIB_OBJ := $(LIB_SRC:%.c=build/tsan/obj/%.o) $(LIB_CXX:%.cc=build/tsan/obj/%.o)
# The suites that share state between threads also run under TSan, which
# sees data races that ASan cannot.
TSAN_BIN := build/tsan/tests/test_core build/tsan/tests/test_tokenizer build/tsan/tests/test_kernels \
            build/tsan/tests/test_rpc build/tsan/tests/test_http build/tsan/tests/test_draft_client \
            build/tsan/tests/test_tp
FUZZ_BIN := $(FUZZ_SRC:tests/fuzz/%.c=build/fuzz/%)
MODEL_BIN := $(MODEL_SRC:tests/model/%.c=build/tests/%)

# The CUDA backend (kernels/cuda/*.cu) is a plugin the services open with
# dlopen (kernels/device.h): build/libaerie-cuda.so, built by nvcc wherever
# nvcc is found, with cudart linked statically so that it loads on a
# machine with no driver and then reports that no GPU is usable.
#   sm_90a: H100/H200 (wgmma); sm_100a: B200 (tcgen05); sm_120: RTX PRO
#   6000 Blackwell (no 'a': its fast path is mma.sync); compute_80 PTX: any
#   other GPU from sm_80 on JITs it ('a' and 'f' PTX never JITs elsewhere).
# --fmad=false: the kernels keep the CPU backend's bits (kn_cuda.h), as
# -ffp-contract=off does for gcc.
NVCC    ?= $(shell command -v nvcc 2>/dev/null || { test -x /usr/local/cuda/bin/nvcc && echo /usr/local/cuda/bin/nvcc; })
CUDA_GENCODE ?= -gencode=arch=compute_90a,code=sm_90a -gencode=arch=compute_100a,code=sm_100a \
                -gencode=arch=compute_120,code=sm_120 -gencode=arch=compute_80,code=compute_80
NVCCFLAGS := -std=c++17 --fmad=false -O2 -g -Werror all-warnings -Xptxas -warn-spills \
             -Xcompiler -fPIC,-fvisibility=hidden,-Wall,-Wextra,-Werror,-Wno-unused-parameter,-pthread
CUDA_SRC := $(sort $(wildcard kernels/cuda/*.cu))
# What every CUDA source may include (nvcc writes no dependency files here).
CUDA_HDR := $(wildcard kernels/cuda/*.h) kernels/backend.h kernels/kernels.h kernels/device.h kernels/draw.h
CUDA_OBJ := $(CUDA_SRC:%.cu=build/cuda/%.o)
CUDA_LIB := build/libaerie-cuda.so
ifneq ($(NVCC),)
CUDA_ALL := $(CUDA_LIB)
CUDA_TEST := cuda-12.8
else
CUDA_ALL := cuda-note
CUDA_TEST :=
endif
# The same kernel sources compiled by g++ against the CPU stand-in for
# CUDA (kernels/cuda/shim), for make test-cuda-cpu.
SHIM_FLAGS := -std=c++17 -DKN_CUDA_SHIM -D_GNU_SOURCE -pthread -ffp-contract=off -MMD -MP -Ibuild/gen \
              -Wall -Wextra -Werror -Wshadow -Wno-unused-parameter
SHIM_SRC := $(CUDA_SRC) kernels/cuda/shim/cuda_shim.cc
ASHIM_OBJ := $(patsubst %,build/asan/shim/%.o,$(SHIM_SRC))
TSHIM_OBJ := $(patsubst %,build/tsan/shim/%.o,$(SHIM_SRC))
# The op test runs under ASan and TSan with a thread per CUDA thread; the
# whole-model tests on a release build with the fiber shim (too slow with
# real threads on 2 cores).
FSHIM_OBJ := $(patsubst %,build/shim/obj/%.o,$(SHIM_SRC))
CUDA_REL_BIN := build/tests/test_cuda_model build/tests/test_cuda_spec
CUDA_CPU_BIN := build/asan/cuda/test_cuda_ops build/tsan/cuda/test_cuda_ops $(CUDA_REL_BIN)
# The plugin built on the shim (release): lets the services and aerie bench
# run --device cuda on a machine with no GPU (tests/integration/test_cuda_shim.py).
SHIM_LIB := build/shim/libaerie-cuda.so
.SECONDARY: $(ASHIM_OBJ) $(TSHIM_OBJ) $(FSHIM_OBJ)

# `make V=1` shows the full command lines.
V ?= 0
ifeq ($(V),0)
Q = @
MSG = @printf '  %-6s %s\n'
else
Q =
MSG = @true
endif

SAN := -fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer

.PHONY: all deps model test check format unit fuzz asan tsan run train-draft clean cuda test-cuda-cpu cuda-note gpu-tests cuda-12.8
.DEFAULT_GOAL := all

SERVICES := build/aerie-target build/aerie-draft build/aerie-gateway
ASAN_SERVICES := $(SERVICES:build/%=build/asan/%)

# Plain make builds what serving needs: the four binaries (and the CUDA
# plugin where nvcc is found). The tests build under make test and make
# check, which install or expect their dependencies (cmocka, clang).
all: build/aerie $(SERVICES) $(CUDA_ALL)

# Every object may include the generated header (an order-only
# prerequisite of each object rule below).
$(GEN_C) $(GEN_H) &: proto/aerie.proto proto/aerie.options
	@mkdir -p $(@D)
	$(MSG) GEN $(GEN_C)
	$(Q)$(NANOPB_GEN) -q -I proto -D build/gen proto/aerie.proto

build/aerie-%: %/main.c build/libaerie.a
	$(MSG) LD $@
	$(Q)$(CC) $(BASE_CFLAGS) $(OPT) $< build/libaerie.a $(LIBS) -o $@

build/asan/aerie-%: %/main.c build/asan/libaerie.a
	@mkdir -p $(@D)
	$(MSG) ASANLD $@
	$(Q)$(CC) $(BASE_CFLAGS) $(SAN_OPT) $(SAN) $< build/asan/libaerie.a $(LIBS) -o $@

$(XGR_LIB): tools/build_xgrammar.sh
	$(Q)tools/build_xgrammar.sh

build/obj/%.o: %.cc | $(GEN_H) $(XGR_LIB)
	@mkdir -p $(@D)
	$(MSG) CXX $@
	$(Q)$(CXX) $(CXXFLAGS_BASE) $(OPT) -c $< -o $@

build/asan/obj/%.o: %.cc | $(GEN_H) $(XGR_LIB)
	@mkdir -p $(@D)
	$(MSG) ASANCXX $@
	$(Q)$(CXX) $(CXXFLAGS_BASE) $(SAN_OPT) $(SAN) -c $< -o $@

build/tsan/obj/%.o: %.cc | $(GEN_H) $(XGR_LIB)
	@mkdir -p $(@D)
	$(MSG) TSANCXX $@
	$(Q)$(CXX) $(CXXFLAGS_BASE) $(SAN_OPT) -fsanitize=thread -c $< -o $@

build/fuzz/obj/%.o: %.cc | $(GEN_H) $(XGR_LIB)
	@mkdir -p $(@D)
	$(MSG) FUZZCXX $@
	$(Q)$(FUZZCXX) $(CXXFLAGS_BASE) -O1 -g -fsanitize=fuzzer-no-link,address,undefined -fno-sanitize=vptr -c $< -o $@

build/obj/%.o: %.c | $(GEN_H)
	@mkdir -p $(@D)
	$(MSG) CC $@
	$(Q)$(CC) $(BASE_CFLAGS) $(OPT) -c $< -o $@

build/asan/obj/%.o: %.c | $(GEN_H)
	@mkdir -p $(@D)
	$(MSG) ASAN $@
	$(Q)$(CC) $(BASE_CFLAGS) $(SAN_OPT) $(SAN) -c $< -o $@

build/tsan/obj/%.o: %.c | $(GEN_H)
	@mkdir -p $(@D)
	$(MSG) TSAN $@
	$(Q)$(CC) $(BASE_CFLAGS) $(SAN_OPT) -fsanitize=thread -c $< -o $@

build/tsan/libaerie.a: $(TLIB_OBJ)
	@mkdir -p $(@D)
	$(MSG) AR $@
	$(Q)rm -f $@ && ar rcs $@ $^

build/tests/%: tests/model/%.c build/libaerie.a
	@mkdir -p $(@D)
	$(MSG) LD $@
	$(Q)$(CC) $(BASE_CFLAGS) $(OPT) $< build/libaerie.a -lcmocka $(LIBS) -o $@

build/tsan/tests/%: tests/unit/%.c build/tsan/libaerie.a
	@mkdir -p $(@D)
	$(MSG) TSANLD $@
	$(Q)$(CC) $(BASE_CFLAGS) $(SAN_OPT) -fsanitize=thread $< build/tsan/libaerie.a -lcmocka $(LIBS) -o $@

build/libaerie.a: $(LIB_OBJ)
	@mkdir -p $(@D)
	$(MSG) AR $@
	$(Q)rm -f $@ && ar rcs $@ $^

build/asan/libaerie.a: $(ALIB_OBJ)
	@mkdir -p $(@D)
	$(MSG) AR $@
	$(Q)rm -f $@ && ar rcs $@ $^

build/aerie: $(CLI_OBJ) build/libaerie.a
	$(MSG) LD $@
	$(Q)$(CC) $(OPT) -pthread $(CLI_OBJ) build/libaerie.a $(LIBS) -o $@

build/asan/aerie: $(ACLI_OBJ) build/asan/libaerie.a
	$(MSG) ASANLD $@
	$(Q)$(CC) -g $(SAN) -pthread $(ACLI_OBJ) build/asan/libaerie.a $(LIBS) -o $@

build/asan/tests/%: tests/unit/%.c build/asan/libaerie.a
	@mkdir -p $(@D)
	$(MSG) ASANLD $@
	$(Q)$(CC) $(BASE_CFLAGS) $(SAN_OPT) $(SAN) $< build/asan/libaerie.a -lcmocka $(LIBS) -o $@

# The plugin loader's test (tests/unit/test_device.c) loads stand-ins for
# the CUDA plugin, built beside it from tests/unit/fake_cuda_plugin.c: one
# of the next backend ABI, one with none, and one of this ABI.
FAKE_PLUGINS := build/asan/tests/fake_cuda_next.so build/asan/tests/fake_cuda_none.so \
                build/asan/tests/fake_cuda_same.so
build/asan/tests/fake_cuda_next.so: FAKE_ABI := -DFAKE_ABI='(KN_BACKEND_ABI + 1)'
build/asan/tests/fake_cuda_same.so: FAKE_ABI := -DFAKE_ABI=KN_BACKEND_ABI
build/asan/tests/fake_cuda_none.so: FAKE_ABI :=
build/asan/tests/fake_cuda_%.so: tests/unit/fake_cuda_plugin.c
	@mkdir -p $(@D)
	$(MSG) FAKESO $@
	$(Q)$(CC) $(BASE_CFLAGS) -O1 -g -fPIC -shared -fvisibility=hidden $(FAKE_ABI) $< -o $@
build/asan/tests/test_device: $(FAKE_PLUGINS)

# The fuzzers link the library built once by clang with fuzzer coverage.
# Its C++ (target/grammar.cc) goes without UBSan's vptr check, whose
# runtime only a C++ link line brings.
FUZZ_FLAGS := -std=c11 -D_GNU_SOURCE -Ibuild/gen -pthread -ffp-contract=off -O1 -g $(WARN) -fno-sanitize-recover=all
FLIB_OBJ := $(LIB_SRC:%.c=build/fuzz/obj/%.o) $(LIB_CXX:%.cc=build/fuzz/obj/%.o)

build/fuzz/obj/%.o: %.c | $(GEN_H)
	@mkdir -p $(@D)
	$(MSG) FUZZ $@
	$(Q)$(FUZZCC) $(FUZZ_FLAGS) -MMD -MP -fsanitize=fuzzer-no-link,address,undefined -c $< -o $@

build/fuzz/libaerie.a: $(FLIB_OBJ)
	$(MSG) AR $@
	$(Q)rm -f $@ && ar rcs $@ $^

build/fuzz/%: tests/fuzz/%.c build/fuzz/libaerie.a
	@mkdir -p $(@D)
	$(MSG) FUZZLD $@
	$(Q)$(FUZZCC) $(FUZZ_FLAGS) -fsanitize=fuzzer,address,undefined $< build/fuzz/libaerie.a $(LIBS) -o $@

build/cuda/%.o: %.cu $(CUDA_HDR)
	@mkdir -p $(@D)
	$(MSG) NVCC $@
	$(Q)$(NVCC) $(NVCCFLAGS) $(CUDA_GENCODE) -c $< -o $@

$(CUDA_LIB): $(CUDA_OBJ)
	$(MSG) NVLD $@
	$(Q)$(NVCC) -shared -cudart static $(CUDA_GENCODE) -Xlinker --no-undefined -Xlinker --exclude-libs,ALL $^ -o $@

ifneq ($(NVCC),)
cuda: $(CUDA_LIB)
else
cuda:
	@echo "make cuda: nvcc not found (install the CUDA toolkit, or set NVCC=path)"; exit 2
endif

# The CUDA backend against CUDA 12.8's headers and ptxas (from PyPI).
cuda-12.8:
	@NVCC=$(NVCC) tools/check_cuda_12_8.sh

cuda-note:
	@echo "  note   nvcc not found: building without the CUDA backend (--device cuda needs make cuda)"

# The CUDA sources on the shim stay at -O1: at -O2, GCC 12's UBSan reports
# the shim's thread_local blockIdx as a null pointer inside k_matmul_qmma.
build/asan/shim/%.o: % $(CUDA_HDR) kernels/cuda/shim/cuda_shim.h | $(GEN_H)
	@mkdir -p $(@D)
	$(MSG) SHIM $@
	$(Q)$(CXX) $(SHIM_FLAGS) -x c++ -O1 -g $(SAN) -c $< -o $@

build/tsan/shim/%.o: % $(CUDA_HDR) kernels/cuda/shim/cuda_shim.h | $(GEN_H)
	@mkdir -p $(@D)
	$(MSG) TSHIM $@
	$(Q)$(CXX) $(SHIM_FLAGS) -x c++ -O1 -g -fsanitize=thread -c $< -o $@

$(SHIM_LIB): $(SHIM_SRC) $(CUDA_HDR) kernels/cuda/shim/cuda_shim.h
	@mkdir -p $(@D)
	$(MSG) SHIMLD $@
	$(Q)$(CXX) $(filter-out -MMD -MP,$(SHIM_FLAGS)) -DSHIM_FIBERS -O2 -g -fPIC -shared -fvisibility=hidden -Wl,--no-undefined \
	    -x c++ $(SHIM_SRC) -o $@ -ldl

build/shim/obj/%.o: % $(CUDA_HDR) kernels/cuda/shim/cuda_shim.h | $(GEN_H)
	@mkdir -p $(@D)
	$(MSG) FSHIM $@
	$(Q)$(CXX) $(SHIM_FLAGS) -DSHIM_FIBERS -x c++ $(OPT) -c $< -o $@

$(CUDA_REL_BIN): build/tests/%: tests/cuda_cpu/%.c $(FSHIM_OBJ) build/libaerie.a
	@mkdir -p $(@D)
	$(MSG) LD $@
	$(Q)$(CC) $(BASE_CFLAGS) $(OPT) $< $(FSHIM_OBJ) build/libaerie.a -lcmocka $(LIBS) -o $@

build/asan/cuda/test_%: tests/cuda_cpu/test_%.c $(ASHIM_OBJ) build/asan/libaerie.a
	@mkdir -p $(@D)
	$(MSG) ASANLD $@
	$(Q)$(CC) $(BASE_CFLAGS) $(SAN_OPT) $(SAN) $< $(ASHIM_OBJ) build/asan/libaerie.a -lcmocka $(LIBS) -o $@

build/tsan/cuda/test_%: tests/cuda_cpu/test_%.c $(TSHIM_OBJ) build/tsan/libaerie.a
	@mkdir -p $(@D)
	$(MSG) TSANLD $@
	$(Q)$(CC) $(BASE_CFLAGS) $(SAN_OPT) -fsanitize=thread $< $(TSHIM_OBJ) build/tsan/libaerie.a -lcmocka $(LIBS) -o $@

# The same op and model tests for a GPU machine (tests/gpu/run.sh): built
# here, where the libraries are, with the shared ones they load copied
# beside them (the GPU machine has none of them and no registry), and the
# CUDA plugin built here (build/gpu/libaerie-cuda.so: nvcc 13 here and
# there, cudart static), so that no device time goes on building.
GPU_TEST_BIN := build/gpu/test_cuda_ops build/gpu/test_cuda_model build/gpu/test_cuda_spec build/gpu/aerie \
    build/gpu/libaerie-cuda.so
# The shared libraries binary $(1) loads, beside it in lib/, but the C and
# C++ runtimes (that machine's are newer, and its nvcc-built plugin needs
# its own libstdc++).
copy_libs = ldd $(1) | awk '/=> \// {print $$3}' | \
    grep -vE '/(libc|libm|libpthread|libdl|librt|libstdc\+\+|libgcc_s|ld-linux[^/]*)\.so' | xargs -r cp -L -t $(dir $(1))lib

build/gpu/test_%: tests/cuda_cpu/test_%.c build/libaerie.a
	@mkdir -p $(@D)/lib
	$(MSG) LD $@
	$(Q)$(CC) $(BASE_CFLAGS) $(OPT) -DKN_TEST_GPU $< build/libaerie.a -lcmocka $(LIBS) -o $@
	$(Q)$(call copy_libs,$@)

# aerie itself, for make-model and bench there.
build/gpu/aerie: build/aerie
	@mkdir -p $(@D)/lib
	$(Q)cp $< $@
	$(Q)$(call copy_libs,$@)

build/gpu/libaerie-cuda.so: $(CUDA_LIB)
	@mkdir -p $(@D)
	$(Q)cp $< $@

gpu-tests: $(GPU_TEST_BIN)

# The CUDA kernels on the CPU, against the CPU backend, under ASan+UBSan
# and under TSan (part of make test, through tools/run_tests.sh).
test-cuda-cpu: $(CUDA_CPU_BIN)
	@tools/run_tests.sh --only $(CUDA_CPU_BIN)

asan: build/asan/aerie $(ASAN_SERVICES) $(UNIT_BIN) $(filter build/asan/%,$(CUDA_CPU_BIN)) $(CUDA_REL_BIN) $(SHIM_LIB)
unit: $(UNIT_BIN)
tsan: $(TSAN_BIN) $(filter build/tsan/%,$(CUDA_CPU_BIN))
fuzz: $(FUZZ_BIN)

# make deps installs everything; each target below installs only what it
# needs (tools/deps.sh run|test|train).
deps:
	@tools/deps.sh all

model:
	@tools/fetch_model.sh

# A random EAGLE-3 head shaped for the default model, for the lossless
# tests (tests/model/test_spec_default.c, pytest): 15 MB, so it is written
# at test time rather than committed.
RANDOM_HEAD := build/heads/smollm2-random
$(RANDOM_HEAD)/model.safetensors: tools/gen_eagle_fixture.py
	$(MSG) GEN $(RANDOM_HEAD)
	$(Q)$(PYTHON) tools/gen_eagle_fixture.py --default-head $(RANDOM_HEAD)

# The build takes every core; then the unit suites run one at a time, the
# fuzzers and the pytest files two at a time (tools/run_tests.sh).
JOBS ?= $(shell nproc 2>/dev/null || echo 2)
# Each step starts with the clock's time: CI has 90 minutes in all.
test:
	@echo "== $$(date -u +%T) dependencies"
	@tools/deps.sh test
	@echo "== $$(date -u +%T) build"
	$(MAKE) -j$(JOBS) all asan tsan fuzz $(MODEL_BIN) $(RANDOM_HEAD)/model.safetensors $(CUDA_TEST)
	@echo "== $$(date -u +%T) model"
	@tools/fetch_model.sh
	@echo "== $$(date -u +%T) tests"
	@tools/run_tests.sh

# The quick loop while working: installs nothing (run make test once
# first) and fuzzes nothing; it fetches the default model if it is missing,
# since the unit suites read it. Builds everything but the fuzzers and TSan
# with warnings as errors, then checks the layout (tools/format.sh), the
# names (tools/check_names.py) and runs the ASan unit suites. A failed check
# does not stop the others; the last line sums them.
check:
	$(MAKE) -j$(JOBS) all $(UNIT_BIN) $(MODEL_BIN)
	@tools/fetch_model.sh
	@tools/check.sh $(UNIT_BIN)

# Rewrites the files that are off the layout (.clang-format).
format:
	@tools/format.sh

# Serving needs the binaries only: the model tests in `all` need cmocka.
run:
	@tools/deps.sh run
	$(MAKE) build/aerie $(SERVICES) $(CUDA_ALL)
	@tools/fetch_model.sh
	@tools/run.sh

# The whole EAGLE-3 pipeline for the default model (tools/train_draft.sh):
# data from the model itself, features and training side by side (streamed),
# export to models/smollm2-135m-eagle3/, evaluation on the held-out prompts.
# Many hours on 2 cores (it prints its estimate per stage); rerunning
# resumes where it stopped.
train-draft:
	@tools/deps.sh train
	$(MAKE) all
	@tools/fetch_model.sh
	@tools/train_draft.sh

clean:
	rm -rf build

-include $(shell find build -name '*.d' 2>/dev/null)
