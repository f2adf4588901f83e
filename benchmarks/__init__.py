"""Side-by-side measurements that write results files; run each module as a script."""
