-- A dead-letter move puts a FIFO message at the back of its group in the
-- dead-letter queue.
--
-- A FIFO dead-letter queue can take messages of one group from more than
-- one place: two source queues sharing it, or sends of its own. A move kept
-- the message's position, which could be lower than that of a message of
-- the same group already in flight in the dead-letter queue: the moved one
-- was then the group's head there and was delivered beside it. Now the
-- receive that moves a FIFO message takes the dead-letter queue's group
-- lock (the lock a send to that queue holds while it draws its id) and
-- gives the message a new position, as a redrive does the other way
-- (migration 0130, receive_tail.sql). It only tries the lock: a message
-- whose group a sender holds there stays for a later receive.
--
-- A move also starts the message's dead-letter count afresh
-- (receive_base), as a redrive does: a dead-letter queue with a
-- dead-letter queue of its own delivers it max_receive_count times before
-- moving it on, where it used to move it on at its first receive.
--
-- The receive learns the group from its own rows, so it derives the lock
-- key in SQL: pgonce::LockKey::new, the derivation `lock::DERIVE_KEY_SQL`
-- documents (first 8 bytes of SHA-256(namespace || 0x00 || key),
-- big-endian, signed). tests/lock.rs checks this function against it.
CREATE FUNCTION pgonce.lock_key(namespace text, key text) RETURNS bigint
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE AS $$
    SELECT ('x' || left(encode(sha256(
               convert_to(namespace, 'UTF8') || '\x00'::bytea || convert_to(key, 'UTF8')
           ), 'hex'), 16))::bit(64)::bigint
$$;

COMMENT ON COLUMN pgonce.queue_message.receive_base IS
    'receive_count when the message came into its queue by a dead-letter move or a redrive (0 when sent): the dead-letter rule counts receive_count - receive_base.';
