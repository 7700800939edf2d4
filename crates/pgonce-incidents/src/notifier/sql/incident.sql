-- What a notification says about incident $1 (any organization: the
-- notifier is internal).
SELECT i.id, i.organization_id, o.name AS organization_name, i.number, i.title, i.lifecycle, i.opened_at
  FROM incidents.incidents i
  JOIN incidents.organizations o ON o.id = i.organization_id
 WHERE i.id = $1
