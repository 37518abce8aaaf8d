"""Speed benchmarks (a package so that `benchmarks.ranks` wins over any installed `benchmarks`)."""
