#!/usr/bin/env bash
# A digest of the Python sources, to tie a GPU run's results to a commit when the machine's copy
# of the checkout carries stale git metadata: run it here on a clean tree and compare.
cd "$(dirname "$0")/../.." && find cgcompile benchmarks tests examples -name '*.py' | LC_ALL=C sort |
  xargs cat | sha1sum | cut -c1-12
