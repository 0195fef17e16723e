raise ImportError("libmissing.so: cannot open shared object file (deliberate test failure)")
