SELECT max(position) FROM pgonce.events
