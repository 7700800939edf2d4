SELECT value FROM incidents.settings WHERE name = $1
