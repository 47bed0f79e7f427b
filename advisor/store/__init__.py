"""Store: the run directories under traces/ (sole owner of their file names) and the history read from them."""
