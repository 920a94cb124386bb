"""What a pack reads: an image folder or a labels file (CSV, JSON Lines), scanned into an ordered plan."""
