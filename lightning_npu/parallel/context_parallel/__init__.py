"""Context parallelism: each sequence split over the ``cp`` ranks (`layout`), attention over the whole sequence by
all-gathering K/V (`attention`), installed on a model and entered around each step (`runtime`)."""
