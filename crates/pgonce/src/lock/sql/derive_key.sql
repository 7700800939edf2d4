-- The advisory lock key of key $2 in namespace $1, as LockKey::new derives
-- it: the first 8 bytes, big-endian, signed, of
-- SHA-256(utf8(namespace) || 0x00 || utf8(key)). PostgreSQL 11 or newer.
-- Text cannot hold NUL, which is why LockKey::new refuses it in both parts.
SELECT ('x' || left(encode(sha256(
           convert_to($1, 'UTF8') || '\x00'::bytea || convert_to($2, 'UTF8')
       ), 'hex'), 16))::bit(64)::bigint AS key
