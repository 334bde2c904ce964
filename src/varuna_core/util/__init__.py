"""Small helpers with no knowledge of training: safe file access (:mod:`.fs`)."""
