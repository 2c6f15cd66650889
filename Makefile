# omlx-cache: a patch series over a pinned mlx-lm, plus the omlx_cache package.
# Set-up for users:  make apply && make test

PY := .venv/bin/python
SHARED ?= $(abspath ../shared)
TEXT ?= $(SHARED)/data/wikitext-2-raw/wiki.test.raw
# MLX's CPU quantized matmul is slow (fp16 40x slower than fp32): on Linux serve the float32
# variant; on macOS (Metal) the 4-bit one.
ifeq ($(shell uname -s),Darwin)
MODEL ?= models/SmolLM2-135M-Instruct
else
MODEL ?= models/SmolLM2-135M-Instruct-f32
endif
SERVE_ARGS ?=
# Debian's OpenBLAS instead of the reference BLAS bundled in mlx-cpu, when it is installed
OPENBLAS := $(wildcard /usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0)
RUN := $(if $(OPENBLAS),LD_PRELOAD=$(OPENBLAS) )
HOST ?= 127.0.0.1
PORT ?= 8080
VERSION ?=
# make check-series K=3: only the prefix of 3 patches (default: every prefix)
K ?=
# make pr 3 (or N=3): patch 3 as a pull request; CLONE=path also makes the branch in a clone of
# ml-explore/mlx-lm (at tag v<pinned version>, or BASE=...)
CLONE ?=
BASE ?=
ifeq (pr,$(firstword $(MAKECMDGOALS)))
ifneq (,$(word 2,$(MAKECMDGOALS)))
N ?= $(word 2,$(MAKECMDGOALS))
$(eval $(word 2,$(MAKECMDGOALS)):;@:)
endif
endif
N ?=

.PHONY: check-series vendor apply unapply refresh pr env test test-upstream test-ours lint models standin serve eval bench upstream-check clean

vendor:
	scripts/series/vendor.sh

apply:
	scripts/series/patches.sh apply
	scripts/env.sh

unapply:
	scripts/series/patches.sh unapply

refresh:
	scripts/series/patches.sh refresh

pr:
	BASE="$(BASE)" scripts/series/patches.sh pr "$(N)" $(CLONE)

env:
	scripts/env.sh

test: standin
	scripts/test.sh

test-upstream: standin
	scripts/test.sh upstream

test-ours: standin
	scripts/test.sh ours

lint:
	$(PY) -m ruff check omlx_cache scripts tests
	$(PY) -m ruff format --check omlx_cache scripts tests
	$(PY) scripts/series/lint_patches.py

models:
	$(PY) -m omlx_cache.models all --out models

standin:
	$(PY) -m omlx_cache.standin --out models/hub

# The server's own hub cache, empty: models/hub holds the tests' random-weight stand-in, which
# /v1/models would list.
SERVE_HUB ?= models/serve-hub

serve: $(MODEL)/config.json
	mkdir -p $(SERVE_HUB)
	$(RUN)HF_HUB_OFFLINE=1 HF_HUB_CACHE=$(abspath $(SERVE_HUB)) $(PY) -m mlx_lm server --model $(MODEL) --host $(HOST) --port $(PORT) $(SERVE_ARGS)

models/%/config.json:
	$(MAKE) models

EVAL_MODEL ?= models/SmolLM2-135M-Instruct-f32
EVAL_ARGS ?=
BENCH_ARGS ?=
# make eval / make bench write here (git-ignored); docs/data holds only the runs the docs cite
EVAL_OUT ?= build/eval
BENCH_OUT ?= build/bench

eval: $(EVAL_MODEL)/config.json
	$(RUN)$(PY) -m omlx_cache.eval --model $(EVAL_MODEL) --text $(TEXT) --out $(EVAL_OUT)/eval-smollm2.json $(EVAL_ARGS)

bench:
	$(RUN)$(PY) -m omlx_cache.bench --out $(BENCH_OUT)/bench-cpu.json --plot-dir $(BENCH_OUT) --plot-prefix bench-cpu $(BENCH_ARGS)

check-series: standin
	scripts/series/check_series.sh $(K)

upstream-check:
	@test -n "$(VERSION)" || { echo "usage: make upstream-check VERSION=x.y.z" >&2; exit 2; }
	scripts/series/patches.sh check $(VERSION)

clean:
	rm -rf vendor/mlx-lm vendor/check vendor/.cache .venv models
