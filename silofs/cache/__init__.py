"""The LMDB cache as both processes read it: the chunk value format (format.py), values
found inside data.mdb before they are touched (bounds.py), the listing's rows and
lookups (listing.py) and the env's read side (store.py). The daemon's write side is
node/store_write.py and node/listing_builder.py; nothing here writes the env.
"""
