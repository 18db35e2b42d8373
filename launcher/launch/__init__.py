"""Starting the ranks: recipe -> command and environment, spawning them, copying results back, stopping them."""
